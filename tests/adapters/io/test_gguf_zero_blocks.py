"""Two GGUF round-trip bugs (issue 25): blocks ggml writes with ``d = 0`` (all-zero blocks; Q4_1 blocks of one
value) import as codes with scale 1 and now go back byte for byte (``formats.gguf.encode`` writes them as ggml
does); a ``ModelConfig`` with ``exclude=()`` and float Linears named in ``by_name`` (what ``from_gguf`` gives)
survives ``to_dict`` / ``from_dict`` and ``export_hf`` -> reload (the Quark ``exclude`` list no longer depends on
the order of ``by_name``, which the JSON writer sorts)."""

import numpy as np
import pytest
import torch

import qcore
from qcore import PerGroup
from qcore.formats import gguf as G

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from qcore.adapters import export_hf, from_pretrained, quantize_model  # noqa: E402
from qcore.adapters.config import LayerConfig, ModelConfig  # noqa: E402
from qcore.adapters.io.gguf import export_gguf, from_gguf  # noqa: E402


def _with_zero_blocks(kind, seed=0):
    """[6, 128] with all-zero blocks (Q4_1: also blocks of one float16 value), the rest random."""
    x = np.random.default_rng(seed).normal(size=(6, 128)).astype(np.float32)
    x[0] = 0
    x[2, 32:64] = 0
    x[5, :32] = 0
    if kind == "Q4_1":
        x[3, 64:96] = 0.5
        x[4, :32] = -3.25
    return x


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_1"])
def test_zero_blocks_of_ggmls_quantizer_go_back_byte_for_byte(kind):
    x = _with_zero_blocks(kind)
    if kind == "Q4_1":  # ggml's Q4_1 of random rows has no qcore grid (m = min): constant blocks only
        x = np.repeat(x[:, ::32], 32, axis=1)
    data = G.quantize_float(x, kind)
    try:
        from qcore.testing.ggml import ggml_library, ggml_quantize
        if ggml_library() is not None:
            assert np.array_equal(np.asarray(ggml_quantize(x, kind)).reshape(data.shape), data)
    except ImportError:
        pass
    spec, parts, reason = G.import_blocks(data, kind, x.shape)
    assert spec is not None, reason
    assert np.array_equal(qcore.dequantize(qcore.QTensor(parts.codes, parts.scales, parts.zero_points, spec)),
                          G.dequantize(data, kind, x.shape))
    assert bytes(G.encode(parts, spec, kind=kind)) == bytes(data)


def _tiny(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kind", ["Q4_0", "Q8_0", "Q4_1"])
def test_ggml_file_with_zero_blocks_converts_to_the_same_bytes(tmp_path, kind):
    from test_import_gguf import _ggml_file
    m = _tiny()
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.weight[:3, :32] = 0
        m.model.layers[0].mlp.down_proj.weight[5, 32:64] = 0
        m.model.layers[0].self_attn.v_proj.weight.zero_()  # every block d = 0: a grid for Q4_1 too
    path = _ggml_file(m, tmp_path / "a.gguf", kind)
    back = from_gguf(path)
    rep = {r.gguf_name: r for r in back.qcore_gguf_report.tensors}
    assert rep["blk.0.attn_v.weight"].how == "codes" and not back.qcore_gguf_report.dequantized
    export_gguf(back, tmp_path / "b.gguf")
    a = {t.name: bytes(np.asarray(t.data)) for t in gguf.GGUFReader(path).tensors}
    b = {t.name: bytes(np.asarray(t.data)) for t in gguf.GGUFReader(tmp_path / "b.gguf").tensors}
    assert a == b


def test_from_gguf_config_with_float_linears_survives_dict_and_export_hf(tmp_path):
    m = _tiny()
    spec = qcore.make_spec("int4", granularity=PerGroup(32, axis=-1), scale_dtype="float16")
    quantize_model(m, ModelConfig(LayerConfig(weight=spec), exclude=("*.up_proj", "lm_head")), None,
                   progress=False)
    export_gguf(m, tmp_path / "a.gguf")
    back = from_gguf(tmp_path / "a.gguf")
    c = back.qcore_config
    assert c.exclude == () and c.by_name["lm_head"] is None and c.by_name["model.layers.0.mlp.up_proj"] is None
    assert ModelConfig.from_dict(c.to_dict()) == c
    # the by_name order does not change what Quark's exclude says (the JSON block is written with sorted keys)
    flipped = ModelConfig(c.layer, by_type=c.by_type, by_name=dict(reversed(list(c.by_name.items()))), exclude=())
    assert flipped.to_quark(model_dtype="float32")["exclude"] == c.to_quark(model_dtype="float32")["exclude"]
    export_hf(back, tmp_path / "hf")
    r = from_pretrained(tmp_path / "hf")
    assert r.qcore_config == c
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(r(ids).logits, back(ids).logits)


@pytest.mark.parametrize("name", ["q6_k", "q3_k", "q4_k", "q2_k", "q5_k"])
def test_kquant_embedding_with_a_zero_row_freezes_to_ggmls_bytes(name):
    """A padding row (all zero) is a k-quant block ggml writes as zero bytes, whose values are -0.0 for the signed
    types (q3_k, q6_k); freeze requantizes the fake-quantized weight under the kept scales and gets the same
    bits (it raised "do not reproduce the fake-quantized weight" before)."""
    from torch import nn
    torch.manual_seed(0)
    seq = nn.Sequential(nn.Embedding(8, 256, padding_idx=0))
    x = seq[0].weight.detach().numpy().copy()
    layer = LayerConfig(weight=name)
    quantize_model(seq, ModelConfig(layer, by_type={"Embedding": layer}, exclude=()), None, progress=False)
    want = bytes(qcore.packing.pack_gguf_blocks(qcore.quantize(x, name)))
    y = seq(torch.arange(8))
    assert bytes(seq[0].gguf_blocks()) == want
    seq[0].freeze()
    assert bytes(seq[0].gguf_blocks()) == want and torch.equal(seq(torch.arange(8)), y)

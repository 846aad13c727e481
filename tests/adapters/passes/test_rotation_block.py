"""QuaRot with block-diagonal rotations of the scale-block size (``{"name": "quarot", "block": b}``; MR-GPTQ's
block rotations): the float model computes the same function, every rotation is block-diagonal, the fused R1 is
MR-GPTQ's per-Linear input transform, ``block="auto"`` takes the weights' block size, checkpoints reload."""

import copy
import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore.adapters as A  # noqa: E402
from qcore.adapters.passes.rotation import input_rotations, rotate_model  # noqa: E402
from qcore.algorithms.hadamard import block_rotation  # noqa: E402
from rotation_kit import rotation_llama  # noqa: E402

_llama = rotation_llama


X = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))


def _r1(orig, rotated):
    """R1 read back from the embedding (``E_rotated = E R1``)."""
    e0 = orig.model.embed_tokens.weight.detach().double()
    return torch.linalg.lstsq(e0, rotated.model.embed_tokens.weight.detach().double()).solution


@pytest.mark.parametrize("hidden, heads, kv, inter, tie, block", [
    (64, 4, 2, 128, False, 16),
    (72, 9, 3, 96, True, 8),     # 9 heads of 8 as SmolLM2's layout, tied embeddings
    (96, 4, 4, 192, False, 12),  # a Paley block (12)
])
@pytest.mark.parametrize("key", [None, 7])
def test_block_rotated_model_computes_the_same_function(hidden, heads, kv, inter, tie, block, key):
    m = _llama(hidden, heads, kv, inter, tie)
    with torch.no_grad():
        ref = m(X).logits
    r = rotate_model(copy.deepcopy(m), key=key, block=block)
    with torch.no_grad():
        torch.testing.assert_close(r(X).logits, ref, rtol=1e-4, atol=1e-4)
    # R1 is the block rotation (read back from the weights), so it mixes features only inside each block
    np.testing.assert_allclose(_r1(m, r).numpy(), block_rotation(hidden, block=block, key=key), atol=1e-5)
    rot = input_rotations(r)
    assert len(rot) == 4 and all(h.block == block for h in rot.values())
    h = rot["model.layers.0.mlp.down_proj"]
    np.testing.assert_array_equal(h.matrix().numpy(), block_rotation(inter, block=block, key=h.key).T)
    # the hook applies the same Q as its dense matrix (the fast path against the float64 product)
    x = torch.randn(3, inter, dtype=torch.float64)
    torch.testing.assert_close(h.apply(x), x @ h.matrix(), rtol=1e-12, atol=1e-12)


def test_a_fused_block_r1_is_mr_gptqs_input_transform():
    """MR-GPTQ puts a block Hadamard on the input of q, k, v, gate and up; with key=None the fused R1 gives each of
    those Linears exactly that input (the original input, without the folded norm weight, times the block
    Hadamard), with no run-time transform."""
    m = _llama()
    b = 16
    r = rotate_model(copy.deepcopy(m), key=None, heads=False, online=(), block=b)
    assert not input_rotations(r)
    seen = {}

    def grab(tag):
        return lambda mod, a: seen.__setitem__(tag, a[0].detach().double())
    hooks = [m.model.layers[1].self_attn.q_proj.register_forward_pre_hook(grab("q")),
             r.model.layers[1].self_attn.q_proj.register_forward_pre_hook(grab("q_rot")),
             m.model.layers[1].mlp.up_proj.register_forward_pre_hook(grab("up")),
             r.model.layers[1].mlp.up_proj.register_forward_pre_hook(grab("up_rot"))]
    with torch.no_grad():
        torch.testing.assert_close(r(X).logits, m(X).logits, rtol=1e-4, atol=1e-4)
    for h in hooks:
        h.remove()
    hb = torch.from_numpy(block_rotation(64, block=b))  # plain (unsigned) block Hadamard, symmetric for Sylvester
    g_attn = m.model.layers[1].input_layernorm.weight.detach().double()
    g_mlp = m.model.layers[1].post_attention_layernorm.weight.detach().double()
    torch.testing.assert_close(seen["q_rot"], (seen["q"] / g_attn) @ hb, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(seen["up_rot"], (seen["up"] / g_mlp) @ hb, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block=16), "does not divide the head size=8"),
    (dict(block=3), "no Hadamard matrix of order 3"),
    (dict(block=16, heads=False, online=("mlp.down_proj",)), "does not divide the input size of mlp.down_proj=72"),
])
def test_bad_blocks_are_refused_before_any_change(kwargs, match):
    m = _llama(heads=8, kv=4, inter=72)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        rotate_model(m, **kwargs)
    assert not input_rotations(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_block_config_is_validated_naming_the_field():
    from qcore.algorithms.config import QuaRotConfig, SpinQuantConfig, parse_algorithm
    assert QuaRotConfig(block=32).block == 32 and QuaRotConfig(block="auto").block == "auto"
    assert "block" not in QuaRotConfig().to_dict()  # full-size rotations: the landed dict
    assert parse_algorithm({"name": "quarot", "block": 16}).to_dict()["block"] == 16
    for bad, match in ((0, "QuaRotConfig.block"), ("32", "QuaRotConfig.block"), (True, "QuaRotConfig.block"),
                       (36 * 2 + 20, "QuaRotConfig.block=92: no Hadamard")):
        with pytest.raises(ValueError, match=match):
            QuaRotConfig(block=bad)
    with pytest.raises(ValueError, match="SpinQuantConfig.block=32"):
        SpinQuantConfig(block=32)
    from qcore.adapters.passes.spinquant import apply_rotation
    m = _llama()
    with pytest.raises(ValueError, match="block='auto' takes the weights' block size"):
        apply_rotation(m, QuaRotConfig(block="auto"))
    with pytest.raises(ValueError, match=r"quarot.block=24: .*does not divide the hidden size=64"):
        apply_rotation(m, QuaRotConfig(block=24))
    assert not input_rotations(m)


def test_auto_block_is_the_weights_block_size_and_reloads(tmp_path):
    m = _llama(heads=2, kv=1, tie=True)  # head size 32: MX's block
    with torch.no_grad():
        ref = m(X).logits
    cfg = A.preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot", "block": "auto"},))
    q = A.quantize_model(copy.deepcopy(m), cfg, progress=False)
    assert q.qcore_config.algorithms[0].block == 32  # MX: 32-element blocks
    assert {h.block for h in input_rotations(q).values()} == {32}
    np.testing.assert_allclose(_r1(m, q).numpy(), block_rotation(64, block=32, key=0), atol=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(q(X).logits, ref, rtol=0.5, atol=0.5)  # quantized: near, not equal
    A.freeze(q)
    A.export_hf(q, tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "qcore"
    back = A.from_pretrained(tmp_path / "ckpt")
    assert {n: (h.size, h.key, h.block) for n, h in input_rotations(back).items()} == \
        {n: (h.size, h.key, h.block) for n, h in input_rotations(q).items()}
    with torch.no_grad():
        torch.testing.assert_close(back(X).logits, q(X).logits, rtol=0, atol=1e-5)
    # nvfp4: 16-element blocks
    n = A.quantize_model(copy.deepcopy(m), A.preset("nvfp4").replace(algorithms=({"name": "quarot", "block": "auto"},)),
                         [X[:1]], progress=False)
    assert n.qcore_config.algorithms[0].block == 16


def test_auto_block_is_refused_without_one_block_size():
    m = _llama(heads=2, kv=1)
    cfg = A.preset("w_int8_per_channel_sym").replace(algorithms=({"name": "quarot", "block": "auto"},))
    with pytest.raises(ValueError, match="quarot.block='auto': the decoder layers' Linears must share one"):
        A.quantize_model(m, cfg, progress=False)
    assert not input_rotations(m)


def test_fused_only_block_rotation_exports_as_quarks_offline_rotation(tmp_path):
    m = _llama(heads=2, kv=1)
    cfg = A.preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot", "block": 32, "online": []},))
    q = A.quantize_model(m, cfg, progress=False)
    assert not input_rotations(q)
    A.freeze(q)
    A.export_hf(q, tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "quark"
    rot = [a for a in qc["algo_config"] if a["name"] == "rotation"][0]
    assert rot["rotation_size"] == 32 and rot["r4"] is False
    back = A.from_pretrained(tmp_path / "ckpt")
    assert back.qcore_config.algorithms[0].block == 32 and not input_rotations(back)
    with torch.no_grad():
        torch.testing.assert_close(back(X).logits, q(X).logits, rtol=0, atol=1e-5)


def test_exporters_without_online_transforms_refuse_the_block_ones_as_the_full_ones():
    from qcore.adapters.io.compressed_tensors import check_ct
    m = _llama(heads=2, kv=1)
    online = A.preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot", "block": "auto"},))
    with pytest.raises(ValueError, match="online rotations"):
        check_ct(m, online)
    fused = A.preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot", "block": 32, "online": []},))
    check_ct(m, fused)  # fuse-only: the weights hold it, any loader runs it

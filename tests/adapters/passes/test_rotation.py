"""QuaRot's fused rotations (qcore.adapters.passes.rotation): the rotated float model computes the same function."""

import copy

import numpy as np

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters.passes.rotation import rotate_model  # noqa: E402
from rotation_kit import rotation_llama  # noqa: E402

_llama = rotation_llama


@pytest.mark.parametrize("hidden, heads, kv, inter, tie", [
    (64, 4, 2, 128, False),
    (72, 9, 3, 96, True),    # 9 heads as SmolLM2, grouped-query, tied embeddings, 72 = Paley I (71)
    (60, 5, 5, 84, False),   # 60: Paley II (29); head_dim 12: Paley I (11)
    (92, 2, 1, 64, False),   # 92 and head_dim 46: no construction here, the block-diagonal fallback
    (36, 3, 1, 52, True),    # head_dim 12, multi-query
])
@pytest.mark.parametrize("key", [None, 7])
def test_rotated_model_computes_the_same_function(hidden, heads, kv, inter, tie, key):
    m = _llama(hidden, heads, kv, inter, tie)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = m(x).logits
    r = rotate_model(copy.deepcopy(m), key=key)
    with torch.no_grad():
        out = r(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(r.model.layers[0].self_attn.q_proj.weight, m.model.layers[0].self_attn.q_proj.weight)
    assert torch.equal(r.model.layers[0].input_layernorm.weight, torch.ones(hidden))
    if tie:
        assert r.lm_head.weight is not r.model.embed_tokens.weight and not r.config.tie_word_embeddings


def test_unsupported_models_are_refused_before_any_change():
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=96, hidden_size=32, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=64))
    with pytest.raises(ValueError, match="not a Llama-like causal LM"):
        rotate_model(bert)
    m = _llama(64, 4, 2, 128, False)
    from qcore.adapters import preset, quantize_model
    quantize_model(m, preset("int8"), [torch.randint(0, 96, (1, 8))], progress=False)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ValueError, match="rotate the float model before quantizing"):
        rotate_model(m)
    for k, v in m.state_dict().items():
        assert torch.equal(v.nan_to_num(), before[k].nan_to_num()), k


@pytest.mark.parametrize("key", [None, 3])
@pytest.mark.parametrize("hidden, heads, kv, inter", [(64, 4, 2, 96), (72, 9, 3, 92)])  # 92: dense fallback
def test_online_rotations_keep_the_function_and_rotate_the_inputs(hidden, heads, kv, inter, key):
    from qcore.adapters.passes.rotation import input_rotations
    m = _llama(hidden, heads, kv, inter, False)
    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    seen = {}
    lin = m.model.layers[1].mlp.down_proj
    h0 = lin.register_forward_pre_hook(lambda mod, a: seen.__setitem__("plain", a[0].detach().clone()))
    with torch.no_grad():
        ref = m(x).logits
    h0.remove()
    r = rotate_model(copy.deepcopy(m), key=key)
    rot = input_rotations(r)
    assert sorted(rot) == sorted(f"model.layers.{i}.{n}" for i in range(2) for n in ("mlp.down_proj",
                                                                                      "self_attn.o_proj"))
    lin = r.model.layers[1].mlp.down_proj
    lin.register_forward_pre_hook(lambda mod, a: seen.__setitem__("rotated", a[0].detach().clone()))
    with torch.no_grad():
        out = r(x).logits
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    q = rot["model.layers.1.mlp.down_proj"].matrix().float()
    torch.testing.assert_close(q @ q.T, torch.eye(inter), atol=1e-6, rtol=0)
    torch.testing.assert_close(seen["rotated"], seen["plain"] @ q, rtol=1e-4, atol=1e-5)
    # survives deepcopy and quantize_model's wrapping (the wrapper shares the hooks)
    from qcore.adapters import preset, quantize_model
    r2 = copy.deepcopy(r)
    assert len(input_rotations(r2)) == 4
    q8 = quantize_model(r2, preset("int8"), [x], progress=False)
    assert len(input_rotations(q8)) == 4
    with torch.no_grad():
        torch.testing.assert_close(q8(x).logits, ref, rtol=0.1, atol=0.1)
    with pytest.raises(ValueError, match="already rotated"):
        rotate_model(r)
    with pytest.raises(ValueError, match="online must be"):
        rotate_model(copy.deepcopy(m), online=("mlp.up_proj",))


def _batches(n=3, seq=16):
    return [torch.randint(0, 96, (1, seq), generator=torch.Generator().manual_seed(10 + i)) for i in range(n)]


def test_quarot_through_quantize_model():
    from qcore.adapters import preset, quantize_model
    from qcore.adapters.passes.rotation import input_rotations
    m = _llama(64, 4, 2, 128, True)
    x = _batches(1)[0]
    with torch.no_grad():
        ref = m(x).logits
    q = quantize_model(copy.deepcopy(m), preset("w_int8_a_int8_per_token_dynamic").replace(algorithms=({"name": "quarot"},)),
                       progress=False)  # no data needed: QuaRot is data-free, dynamic activations
    assert len(input_rotations(q)) == 4
    assert [a.name for a in q.qcore_config.algorithms] == ["quarot"]
    with torch.no_grad():
        torch.testing.assert_close(q(x).logits, ref, rtol=0.05, atol=0.05)
    # QuaRot then GPTQ: the Hessians are taken from the rotated inputs (the hooks run before GPTQ's)
    g = quantize_model(copy.deepcopy(m), preset("w_mxfp4_a_mxfp4").replace(
        algorithms=({"name": "quarot"}, {"name": "gptq"})), _batches(), progress=False)
    assert len(input_rotations(g)) == 4
    with pytest.raises(ValueError, match="need calibration data"):
        quantize_model(copy.deepcopy(m), preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "spinquant"},)),
                       progress=False)


def test_spinquant_learns_an_orthogonal_rotation_and_keeps_the_float_function():
    from qcore.adapters import plan_model, preset
    from qcore.adapters.passes.rotation import rotate_model
    from qcore.adapters.passes.spinquant import apply_rotation
    from qcore.algorithms.config import SpinQuantConfig
    from qcore.algorithms.orthogonal import orthogonality_error
    m = _llama(64, 4, 2, 128, False)
    x = _batches(1)[0]
    with torch.no_grad():
        ref = m(x).logits
    cfg = preset("w_int4_a_int4_per_token_dynamic", group_size=32)
    plans = plan_model(m, cfg)
    s = apply_rotation(copy.deepcopy(m), SpinQuantConfig(steps=6, lr=0.5), plans=plans, data=_batches(),
                       progress=False)
    losses = s._qcore_spinquant_losses
    assert len(losses) == 6 and all(np.isfinite(losses))
    with torch.no_grad():
        torch.testing.assert_close(s(x).logits, ref, rtol=1e-4, atol=1e-4)
    # the learnt R1, read back from the embedding (emb_rotated = emb @ R1): orthogonal, and not QuaRot's
    e0 = m.model.embed_tokens.weight.detach().double()
    r1 = torch.linalg.lstsq(e0, s.model.embed_tokens.weight.detach().double()).solution
    assert orthogonality_error(r1) < 1e-4
    h = rotate_model(copy.deepcopy(m))
    assert not torch.allclose(s.model.embed_tokens.weight, h.model.embed_tokens.weight, atol=1e-4)
    with pytest.raises(ValueError, match="already rotated"):
        apply_rotation(s, SpinQuantConfig(steps=1), plans=plans, data=_batches())
    with pytest.raises(ValueError, match="non-empty list"):
        apply_rotation(copy.deepcopy(m), SpinQuantConfig(steps=1), plans=plans, data=[])


@pytest.mark.parametrize("online", [("mlp.down_proj", "self_attn.o_proj"), ()])
def test_rotated_checkpoints_export_and_reload(online, tmp_path):
    import json

    import qcore.adapters as A
    from qcore.adapters.passes.rotation import input_rotations
    m = _llama(64, 4, 2, 128, True)
    x = _batches(1)[0]
    algo = {"name": "quarot", "key": 4, "online": list(online)}
    q = A.quantize_model(m, A.preset("w_mxfp4_a_mxfp4").replace(algorithms=(algo,)), progress=False)
    A.freeze(q)
    A.export_hf(q, tmp_path / "ckpt")
    qc = json.loads((tmp_path / "ckpt" / "config.json").read_text())["quantization_config"]
    # online transforms: Quark's / vLLM's loaders would not apply them, so the checkpoint is a qcore one
    assert qc["quant_method"] == ("qcore" if online else "quark")
    back = A.from_pretrained(tmp_path / "ckpt")
    assert {n: (h.size, h.key) for n, h in input_rotations(back).items()} == \
        {n: (h.size, h.key) for n, h in input_rotations(q).items()}
    assert len(input_rotations(back)) == 2 * len(online)
    with torch.no_grad():
        torch.testing.assert_close(back(x).logits, q(x).logits, rtol=0, atol=1e-5)


def test_export_refuses_rotations_the_config_does_not_describe(tmp_path):
    import qcore.adapters as A
    from qcore.adapters.passes.rotation import rotate_model
    m = rotate_model(_llama(64, 4, 2, 128, False))  # hooks, but the quantization config names no rotation
    q = A.quantize_model(m, A.preset("w_mxfp4_a_mxfp4"), progress=False)
    with pytest.raises(ValueError, match="online rotations"):
        A.export_hf(q, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_spinquant_trains_without_weight_quantization_when_gptq_follows(monkeypatch):
    import qcore.adapters.passes.spinquant as S
    from qcore.adapters import preset, quantize_model
    seen = []
    real = S.spinquant

    def spy(*a, **kw):
        seen.append(kw["train_weights"])
        return real(*a, **kw)

    monkeypatch.setattr(S, "spinquant", spy)
    m = _llama(64, 4, 2, 128, False)
    for algos, want in ((({"name": "spinquant", "steps": 1},), True),
                        (({"name": "spinquant", "steps": 1}, {"name": "gptq"}), False),
                        (({"name": "spinquant", "steps": 1, "train_weights": True}, {"name": "gptq"}), True)):
        quantize_model(copy.deepcopy(m), preset("w_mxfp4_a_mxfp4").replace(algorithms=algos), _batches(),
                       progress=False)
        assert seen[-1] is want
    with pytest.raises(ValueError, match="nothing to train for"):  # weight-only scheme, weights not trained
        quantize_model(copy.deepcopy(m), preset("mxfp4_weight_only").replace(
            algorithms=({"name": "spinquant", "steps": 1}, {"name": "gptq"})), _batches(), progress=False)


def test_a_failed_spinquant_leaves_the_float_function(monkeypatch):
    import qcore.adapters.passes.spinquant as S
    from qcore.adapters import plan_model, preset
    from qcore.adapters.passes.rotation import input_rotations
    from qcore.adapters.passes.spinquant import apply_rotation
    from qcore.algorithms.config import SpinQuantConfig
    m = _llama(64, 4, 2, 128, False)
    x = _batches(1)[0]
    with torch.no_grad():
        ref = m(x).logits

    def boom(*a, **kw):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(S, "cayley_step", boom)
    cfg = preset("w_mxfp4_a_mxfp4")
    with pytest.raises(RuntimeError, match="interrupted"):
        apply_rotation(m, SpinQuantConfig(steps=2), plans=plan_model(m, cfg), data=_batches())
    assert not input_rotations(m)
    with torch.no_grad():
        torch.testing.assert_close(m(x).logits, ref, rtol=1e-4, atol=1e-4)


def test_online_order_does_not_change_the_keys():
    from qcore.adapters.passes.rotation import input_rotations, online_plan
    from qcore.algorithms.config import QuaRotConfig
    m = rotate_model(_llama(64, 4, 2, 128, False), key=0, online=("self_attn.o_proj", "mlp.down_proj"))
    want = online_plan(m, QuaRotConfig(key=0, online=("self_attn.o_proj", "mlp.down_proj")))
    assert {n: (h.size, h.key) for n, h in input_rotations(m).items()} == {n: (h.size, h.key) for n, h in want.items()}


def test_quark_online_rotations_are_refused_on_reload(tmp_path):
    import json

    import qcore.adapters as A
    m = _llama(64, 4, 2, 128, False)
    q = A.quantize_model(m, A.preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot", "online": []},)),
                         progress=False)
    A.export_hf(q, tmp_path / "ckpt")
    cfg_path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "quark" and qc["algo_config"][0]["name"] == "rotation"
    A.from_pretrained(tmp_path / "ckpt")  # fused only: loads
    qc["algo_config"][0]["r4"] = True  # Quark's online R4: its own Hadamard tables
    qc.pop("qcore", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="Quark's own Hadamard tables"):
        A.from_pretrained(tmp_path / "ckpt")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_spinquant_on_a_half_precision_model(dtype):
    """Issue 33: SpinQuant on a bfloat16 model crashed on its first step (float32 rotated weights and hooks' outputs
    beside the model's bfloat16 tensors). The rotations are trained in float32 and cast back: the steps run, the
    model keeps its dtype, and the rotated float model computes the same function within the dtype's rounding."""
    from qcore.adapters import plan_model, preset, quantize_model
    from qcore.adapters.passes.spinquant import apply_rotation
    from qcore.algorithms.config import SpinQuantConfig
    m = _llama(64, 4, 2, 128, False).to(dtype)
    x = _batches(1)[0]
    with torch.no_grad():
        ref = m(x).logits.float()
    cfg = preset("w_int4_a_int4_per_token_dynamic", group_size=32)
    s = apply_rotation(copy.deepcopy(m), SpinQuantConfig(steps=2, lr=0.5), plans=plan_model(m, cfg), data=_batches(),
                       progress=False)
    assert len(s._qcore_spinquant_losses) == 2 and all(np.isfinite(s._qcore_spinquant_losses))
    assert {p.dtype for p in s.parameters()} == {dtype}
    with torch.no_grad():
        got = s(x).logits.float()
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    q = quantize_model(copy.deepcopy(m), preset("int4_wo_32").replace(algorithms=({"name": "spinquant", "steps": 1},)),
                       _batches(), progress=False)  # the path `qcore quantize --dtype bfloat16 --algo spinquant` takes
    with torch.no_grad():
        assert torch.isfinite(q(x).logits.float()).all()

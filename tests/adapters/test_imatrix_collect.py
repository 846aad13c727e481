"""Importance matrices of torch models (src/qcore/adapters/imatrix.py): collection against inputs captured by plain hooks,
padding left out, llama.cpp's names and files, and the point of it all: llama.cpp's weighted error with the
collected imatrix is lower than without."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import qcore  # noqa: E402
from qcore.adapters.imatrix import (collect_imatrix, load_imatrix, module_quant_weights,  # noqa: E402
                                    save_imatrix)
from qcore.algorithms.imatrix import quant_weights  # noqa: E402


def _captured_inputs(model, batches, name):
    """Every input row of module ``name`` over the batches (a plain forward hook), float64."""
    rows = []
    h = model.get_submodule(name).register_forward_pre_hook(lambda m, a: rows.append(a[0].detach().double()))
    with torch.no_grad():
        for b in batches:
            model(b)
    h.remove()
    return torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]).numpy()


def test_collect_gguf_names_and_reference(zoo):
    m = zoo.tiny_llama()
    batches = zoo.token_batches(2, seed=1)
    st = collect_imatrix(m, batches, progress=False)
    want = {f"blk.{i}.{t}.weight" for i in range(2) for t in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                              "ffn_gate", "ffn_up", "ffn_down")}
    assert set(st) == want  # no output.weight (llama-imatrix without --process-output), no token_embd
    for key, mod in (("blk.1.attn_q.weight", "model.layers.1.self_attn.q_proj"),
                     ("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj")):
        x = _captured_inputs(m, batches, mod)
        ref = np.array([sum(float(v) * float(v) for v in x[:, j]) for j in range(x.shape[1])])
        np.testing.assert_allclose(st[key].sums[0], ref, rtol=1e-12)
        assert st[key].counts.tolist() == [x.shape[0]] == [32]
    # q, k, v read the same input
    np.testing.assert_array_equal(st["blk.0.attn_q.weight"].sums, st["blk.0.attn_v.weight"].sums)
    by_mod = collect_imatrix(m, batches, names="module", process_output=True, progress=False)
    assert "lm_head" in by_mod and "model.layers.0.mlp.up_proj" in by_mod
    np.testing.assert_array_equal(by_mod["model.layers.0.mlp.up_proj"].sums, st["blk.0.ffn_up.weight"].sums)
    assert "output.weight" in collect_imatrix(m, batches, process_output=True, progress=False)


def test_padding_is_left_out(zoo):
    m = zoo.tiny_llama()
    ids = zoo.token_batches(1, seed=3, batch=1, seq=8)[0]
    padded = {"input_ids": torch.cat([ids, torch.zeros(1, 4, dtype=ids.dtype)], 1),
              "attention_mask": torch.cat([torch.ones(1, 8), torch.zeros(1, 4)], 1).long()}
    a = collect_imatrix(m, [padded], progress=False)
    b = collect_imatrix(m, [ids], progress=False)
    for k in b:
        assert a[k].counts.tolist() == b[k].counts.tolist() == [8]
        np.testing.assert_allclose(a[k].sums, b[k].sums, rtol=1e-5)


def test_files_and_module_weights(zoo, tmp_path):
    m = zoo.tiny_llama()
    st = collect_imatrix(m, zoo.token_batches(2, seed=1), progress=False)
    for name in ("imatrix.gguf", "imatrix.dat"):
        p = tmp_path / name
        save_imatrix(st, p, datasets="calib.txt", chunk_size=16)
        back = load_imatrix(p, chunk_size=16)
        assert set(back) == set(st)
        qw = module_quant_weights(m, back)
        assert set(qw) == {n for n in dict(m.named_modules()) if ".layers." in n and n.endswith("_proj")}
        ref = quant_weights(st["blk.1.ffn_down.weight"])
        np.testing.assert_allclose(qw["model.layers.1.mlp.down_proj"], ref, rtol=3e-7)
        if name.endswith("gguf"):  # the GGUF file keeps sums and counts: the weights are the same bits
            np.testing.assert_array_equal(qw["model.layers.1.mlp.down_proj"], ref)
    with pytest.raises(ValueError, match="format='gguf' or 'dat'"):
        save_imatrix(st, tmp_path / "imatrix.bin")
    with pytest.raises(ValueError, match="another model"):
        module_quant_weights(m, {"blk.0.ffn_down.weight": st["blk.0.ffn_up.weight"]})
    with pytest.raises(ValueError, match="names must be one of"):
        collect_imatrix(m, [], names="hf")
    with pytest.raises(TypeError, match="iterable of calibration batches"):
        collect_imatrix(m, zoo.token_batches(1, seed=1)[0])


def test_imatrix_lowers_llama_cpp_weighted_error():
    """On a tiny Llama 256 wide (k-quant rows), with norm weights spread like a trained model's (some input
    channels much larger than others), the imatrix collected from calibration tokens makes llama.cpp's
    quantizer's weighted error sum_j qw_j (w_ij - q_ij)^2 lower for every k-quant, and the output error on
    other tokens lower too."""
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    m = transformers.LlamaForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for ln in (m.model.layers[0].input_layernorm, m.model.layers[0].post_attention_layernorm):
            ln.weight.copy_(torch.exp(torch.randn(256, generator=g)))
    calib = [torch.randint(0, 128, (2, 32), generator=g) for _ in range(3)]
    held = [torch.randint(0, 128, (2, 32), generator=g)]
    qw = module_quant_weights(m, collect_imatrix(m, calib, progress=False))
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        w = m.get_submodule(name).weight.detach().numpy()
        x = _captured_inputs(m, held, name).astype(np.float32)
        for t in ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k"):
            err, out = [], []
            for im in (None, qw[name]):
                q = np.asarray(qcore.dequantize(qcore.quantize(w, qcore.make_spec(t), imatrix=im)))
                err.append(float((qw[name] * (w - q) ** 2).sum(dtype=np.float64)))
                out.append(float(((x @ (w - q).T) ** 2).mean(dtype=np.float64)))
            assert err[1] < 0.9 * err[0], (name, t, err)
            assert out[1] < out[0], (name, t, out)


def test_cli_imatrix(lm_dir, tmp_path, capsys):
    from qcore.cli import main

    out = tmp_path / "m.gguf"
    argv = ["imatrix", "--model", str(lm_dir), "--eval-text", str(lm_dir.parent / "text.txt"), "--seq-len", "64",
            "--calib-samples", "2", "--output", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "14 tensors over 2 windows (128 tokens)" in capsys.readouterr().out
    st = load_imatrix(out)
    assert len(st) == 14 and all(s.counts.tolist() == [128] for s in st.values())
    from qcore.formats.imatrix import read_imatrix

    g = read_imatrix(out)
    assert g.chunk_size == 64 and g.chunk_count == 2 and g.datasets == (str(lm_dir.parent / "text.txt"),)
    assert main(argv) == 2 and "exists" in capsys.readouterr().err  # no --overwrite
    assert main(argv[:-3] + ["--output", str(tmp_path / "m.bin"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "an imatrix file is named .gguf (llama.cpp's default format) or .dat" in err
    assert not (tmp_path / "m.bin").exists()


def test_experts_per_expert_routed_tokens(zoo):
    """Mixtral's fused experts: per expert, only the tokens routed to it (llama.cpp's mul_mat_id branch), for
    ffn_gate_exps / ffn_up_exps (the expert's input) and ffn_down_exps (act(gate) * up, recomputed: checked by
    rebuilding the experts module's output from it)."""
    m = zoo.tiny_family("mixtral")
    batches = zoo.token_batches(2, seed=1)
    st = collect_imatrix(m, batches, progress=False)
    ex = m.model.layers[1].mlp.experts
    calls = []
    h = ex.register_forward_hook(lambda mod, a, out: calls.append((a[0].detach(), a[1].detach(), a[2].detach(),
                                                                   out.detach())))
    with torch.no_grad():
        for b in batches:
            m(b)
    h.remove()
    E, H, I = 4, ex.gate_up_proj.shape[2], ex.down_proj.shape[2]
    s_in, s_dn, cnt = np.zeros((E, H)), np.zeros((E, I)), np.zeros(E, np.int64)
    for x, idx, w, out in calls:
        rebuilt = torch.zeros_like(out)
        for t in range(x.shape[0]):
            for slot in range(idx.shape[1]):
                e = int(idx[t, slot])
                g, u = (ex.gate_up_proj[e].detach() @ x[t]).chunk(2)
                hid = ex.act_fn(g) * u
                rebuilt[t] += w[t, slot] * (ex.down_proj[e].detach() @ hid)
                cnt[e] += 1
                s_in[e] += x[t].double().numpy() ** 2
                s_dn[e] += hid.double().numpy() ** 2
        torch.testing.assert_close(rebuilt, out, rtol=1e-5, atol=1e-6)
    assert cnt.sum() == 32 * 2
    for t in ("ffn_gate_exps", "ffn_up_exps"):
        np.testing.assert_allclose(st[f"blk.1.{t}.weight"].sums, s_in, rtol=1e-6)
        assert st[f"blk.1.{t}.weight"].counts.tolist() == cnt.tolist()
    np.testing.assert_allclose(st["blk.1.ffn_down_exps.weight"].sums, s_dn, rtol=1e-5)
    assert st["blk.1.ffn_down_exps.weight"].counts.tolist() == cnt.tolist()
    qw = quant_weights(st["blk.1.ffn_down_exps.weight"])
    assert qw.shape == (4, I)  # row e: expert e's quant_weights


def test_names_gguf_needs_a_gguf_family(zoo):
    m = zoo.tiny_bert()
    with pytest.raises(ValueError, match="names='module'"):
        collect_imatrix(m, zoo.token_batches(1, seed=1), progress=False)
    st = collect_imatrix(m, zoo.token_batches(1, seed=1), names="module", progress=False)
    enc = {k: s for k, s in st.items() if k.startswith("encoder.layer.")}
    assert enc and all(s.counts.tolist() == [16] for s in enc.values())  # (the pooler sees one token a sequence)

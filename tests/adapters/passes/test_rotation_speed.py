"""Issue 23, rotations made fast: each fast path against the landed one kept as a reference.

- ``fwht`` on torch tensors (blocked, in place) is bit-identical to ``reference_fwht`` (the landed transform);
- ``InputRotation`` (cached signs, the adjoint transform as its backward) gives the landed forward bit for bit and
  its gradient within float rounding;
- QuaRot + GPTQ gives the same bytes with the fast online transform as with the landed one;
- the fast SpinQuant step (``W Q`` once, the embedding's output and the head's input rotated) trains the landed
  rotations within the tolerance docs/rotations.md states ('Speed').
"""

import copy
import functools
import math
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from qcore.adapters import plan_model, preset, quantize_model  # noqa: E402
from qcore.adapters import modules as M  # noqa: E402
from qcore.adapters.passes import rotation as R  # noqa: E402
from qcore.adapters.passes import spinquant as S  # noqa: E402
from qcore.algorithms.config import SpinQuantConfig  # noqa: E402
from qcore.algorithms.hadamard import fwht, hadamard, reference_fwht  # noqa: E402
from rotation_kit import rotation_llama  # noqa: E402

_llama = functools.partial(rotation_llama, 72, 9, 3, 96, tie=True)


def _data(n=3, seq=24, vocab=96):
    return [torch.randint(0, vocab, (1, seq), generator=torch.Generator().manual_seed(i)) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 4, 12, 16, 20, 36, 60, 72, 128, 576, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fast_fwht_is_bit_identical_to_the_landed_transform(n, dtype):
    g = torch.Generator().manual_seed(n)
    for rows in (0, 1, 5, 300):  # 300 rows of 576 features: several blocks, the last one partial
        x = (torch.randn(rows, n, generator=g) * 10 ** torch.randint(-3, 4, (rows, 1), generator=g)).to(dtype)
        got, want = fwht(x), reference_fwht(x)
        assert got.dtype == want.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want), (n, dtype, rows)


def test_fast_fwht_axis_and_low_precision_inputs():
    x = torch.randn(3, 72, 5)
    assert torch.equal(fwht(x, axis=1), reference_fwht(x, axis=1))
    b = torch.randn(2, 4, 576).to(torch.bfloat16)
    assert torch.equal(fwht(b), reference_fwht(b)) and fwht(b).dtype == torch.float32
    assert np.array_equal(fwht(x.numpy(), axis=1), reference_fwht(x.numpy(), axis=1))  # numpy: the landed code


@pytest.mark.parametrize("n", [16, 20, 36, 72, 1536])
def test_fwht_transpose_is_the_adjoint(n):
    x = torch.randn(4, n, dtype=torch.float64)
    h = torch.from_numpy(hadamard(n).astype(np.float64)) / math.sqrt(n)
    torch.testing.assert_close(fwht(x), x @ h.T, rtol=0, atol=1e-12)
    torch.testing.assert_close(fwht(x, transpose=True), x @ h, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="transpose"):
        fwht(x.numpy(), transpose=True)


@pytest.mark.parametrize("size, key", [(576, 2), (576, None), (48, 5), (92, 3)])  # 92: the dense fallback
def test_input_rotation_forward_is_the_landed_one_and_its_gradient_within_rounding(size, key):
    fast, ref = R.InputRotation(size, key=key), M.ReferenceInputRotation(size, key=key)
    x = torch.randn(2, 7, size)
    with torch.no_grad():
        assert torch.equal(fast.apply(x), ref.apply(x))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    w = torch.randn(2, 7, size)
    ya, yb = fast.apply(xa), ref.apply(xb)
    assert torch.equal(ya.detach(), yb.detach())  # the forward under autograd: the same bits
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    # the cached signs / matrix do not travel: a deep copy and a pickle rebuild them
    for other in (copy.deepcopy(fast), pickle.loads(pickle.dumps(fast))):
        assert other._cache == {} and repr(other) == repr(fast)
        with torch.no_grad():
            assert torch.equal(other.apply(x), ref.apply(x))


def test_quarot_gptq_gives_the_bytes_of_the_landed_online_transform(monkeypatch):
    m = _llama()
    data = _data()
    cfg = preset("w_mxfp4_a_mxfp4").replace(algorithms=({"name": "quarot"}, {"name": "gptq"}))
    a = quantize_model(copy.deepcopy(m), cfg, data, progress=False)
    monkeypatch.setattr(M.InputRotation, "apply", M.ReferenceInputRotation.apply)
    b = quantize_model(copy.deepcopy(m), cfg, data, progress=False)
    monkeypatch.undo()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert torch.equal(sa[k], sb[k]), k
    with torch.no_grad():
        assert torch.equal(a(data[0]).logits, b(data[0]).logits)


def test_rotated_weights_from_a_start_and_with_skips():
    m = _llama(tie=False)
    R.fold_norms_and_untie(m, *R.rotation_parts(m)[:4])
    r1 = torch.from_numpy(R.rotation(72, key=0)).float()
    full = R.rotated_weights(m, r1, None, dtype=torch.float32)
    q = torch.linalg.qr(torch.randn(96, 96))[0]
    k = "model.layers.0.mlp.down_proj.weight"
    got = R.rotated_weights(m, r1, None, dtype=torch.float32, start={k: m.get_parameter(k).detach() @ q},
                            skip=("model.embed_tokens.weight", "lm_head.weight"))
    assert "model.embed_tokens.weight" not in got and "lm_head.weight" not in got
    torch.testing.assert_close(got[k], full[k] @ q, rtol=1e-5, atol=1e-6)
    for n in full:
        if n not in (k, "model.embed_tokens.weight", "lm_head.weight"):
            assert torch.equal(got[n], full[n]), n


@pytest.mark.parametrize("scheme, train_weights, key, heads", [
    ("w_mxfp4_a_mxfp4", True, 0, True),
    ("w_mxfp4_a_mxfp4", False, None, True),
    ("w_mxfp4_a_mxfp4", True, 3, False),
])
def test_fast_spinquant_trains_the_landed_rotations(scheme, train_weights, key, heads):
    m = _llama()
    data = _data()
    algo = SpinQuantConfig(key=key, steps=3, lr=1.5, heads=heads, train_weights=train_weights)
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    S._reference_spinquant(a, plan_model(a, preset(scheme)), data, algo, train_weights=train_weights)
    S.spinquant(b, plan_model(b, preset(scheme)), data, algo, train_weights=train_weights)
    np.testing.assert_allclose(b._qcore_spinquant_losses, a._qcore_spinquant_losses, rtol=1e-5)
    assert len(b._qcore_spinquant_step_s) == 3
    sa, sb = a.state_dict(), b.state_dict()
    for k in sa:
        torch.testing.assert_close(sb[k], sa[k], rtol=1e-4, atol=1e-5)
    assert R.input_rotations(b).keys() == R.input_rotations(a).keys()
    assert all(type(h) is R.InputRotation for h in R.input_rotations(a).values())  # the landed hooks swapped back
    with torch.no_grad():
        torch.testing.assert_close(b(data[0]).logits, a(data[0]).logits, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(b(data[0]).logits, m(data[0]).logits, rtol=1e-4, atol=1e-4)  # same function


def test_fast_spinquant_with_int4_stays_within_the_documented_tolerance():
    # int4's grid is coarse: a 1e-7 difference in an activation flips a rounding now and then, so the losses agree
    # to about 1e-3 and the rotations move apart by more than float rounding (docs/rotations.md, 'Speed')
    m = _llama()
    data = _data()
    algo = SpinQuantConfig(key=0, steps=2, lr=1.5, train_weights=True)
    a, b = copy.deepcopy(m), copy.deepcopy(m)
    cfg = preset("w_int4_a_int4_per_token_dynamic")
    S._reference_spinquant(a, plan_model(a, cfg), data, algo, train_weights=True)
    S.spinquant(b, plan_model(b, cfg), data, algo, train_weights=True)
    np.testing.assert_allclose(b._qcore_spinquant_losses, a._qcore_spinquant_losses, rtol=5e-3)
    with torch.no_grad():
        torch.testing.assert_close(b(data[0]).logits, m(data[0]).logits, rtol=1e-4, atol=1e-4)

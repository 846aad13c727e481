"""AWQ (qcore.algorithms.awq): the scale search and the clipping search against direct transcriptions, their
effect on uint4 group-64 output error, numpy == torch bit for bit, both loss paths, argument checks."""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import qcore  # noqa: E402
from qcore.algorithms.awq import AWQResult, awq_clip, awq_search  # noqa: E402

U4G64 = qcore.make_spec("uint4", granularity=qcore.PerGroup(64, axis=1))  # asymmetric, as Quark's uint4_wo_64


def salient_data(seed=0, t=256, n=192, outs=(96,), salient=8, factor=30.0):
    """Activations with a few salient channels (mean |x| much larger), random weights."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, n)).astype(np.float32)
    x[:, rng.choice(n, salient, replace=False)] *= factor
    ws = [(rng.standard_normal((o, n)) * 0.05).astype(np.float32) for o in outs]
    return x, ws


def out_error(x, w, wq_over_s):
    """mean (x W^T - x (Q(W s)/s)^T)^2 in float64."""
    x64 = x.astype(np.float64)
    return float(np.mean((x64 @ w.astype(np.float64).T - x64 @ wq_over_s.T) ** 2))


def awq_loss(x, ws, s, spec=U4G64):
    """The search's loss, transcribed: sum_i mean (x W_i^T - (x/s) Q(W_i s)^T)^2."""
    s64 = s.astype(np.float64)
    return sum(out_error(x, w, qcore.fake_quantize(w * s, spec).astype(np.float64) / s64) for w in ws)


# ---- scale search -----------------------------------------------------------------------------------------------


def test_search_matches_a_transcription_and_never_loses_to_rtn():
    x, ws = salient_data(outs=(96, 48))
    r = awq_search(x, ws, U4G64)
    assert isinstance(r, AWQResult) and r.scales.dtype == np.float32 and r.scales.shape == (192,)
    ratios = [k for k, _ in r.losses]
    assert ratios == [k / 20 for k in range(20)]
    assert r.losses[0][1] == pytest.approx(awq_loss(x, ws, np.ones(192, np.float32)), rel=1e-9)  # ratio 0 = RTN
    assert r.loss == min(v for _, v in r.losses) and r.loss <= r.losses[0][1]
    # The scales: mean|x| ** ratio, clamped, normalised by sqrt(max * min), then float32.
    m = np.abs(x.astype(np.float64)).mean(0)
    s = np.maximum(m ** r.ratio, 1e-4)
    np.testing.assert_array_equal(r.scales, (s / np.sqrt(s.max() * s.min())).astype(np.float32))
    assert r.loss == pytest.approx(awq_loss(x, ws, r.scales), rel=1e-9)


def test_search_lowers_uint4_g64_error_on_salient_channels():
    x, ws = salient_data(1)
    r = awq_search(x, ws, U4G64)
    rtn = awq_loss(x, ws, np.ones(x.shape[1], np.float32))
    assert r.ratio > 0 and r.loss < 0.7 * rtn, (r.ratio, r.loss, rtn)


def test_ratio_zero_wins_ties():
    # Identical channels: every candidate is s = 1, so every loss ties and ratio 0 must be kept.
    x = np.ones((32, 64), np.float32)
    w = np.random.default_rng(2).standard_normal((16, 64)).astype(np.float32)
    r = awq_search(x, [w], U4G64)
    assert r.ratio == 0.0 and np.all(r.scales == 1)


def test_gram_and_direct_paths_agree():
    x, ws = salient_data(3, outs=(64, 32))
    a = awq_search(x, ws, U4G64, gram=True)
    b = awq_search(x, ws, U4G64, gram=False)
    assert a.ratio == b.ratio and np.array_equal(a.scales, b.scales)
    for (_, la), (_, lb) in zip(a.losses, b.losses):  # non-finalists: float32-product screened losses
        assert la == pytest.approx(lb, rel=1e-5)
    # The landed one-pass search (every loss in float64): the two paths agree to float64 rounding.
    from qcore.algorithms.awq import _reference_awq_search
    ra = _reference_awq_search(x, ws, U4G64, gram=True)
    rb = _reference_awq_search(x, ws, U4G64, gram=False)
    for (_, la), (_, lb) in zip(ra.losses, rb.losses):
        assert la == pytest.approx(lb, rel=1e-10)


def test_per_weight_specs_and_any_spec():
    x, ws = salient_data(4, outs=(32, 32))
    specs = [U4G64, qcore.make_spec("mxfp4", axis=1)]
    r = awq_search(x, ws, specs, grid=5)
    assert [k for k, _ in r.losses] == [0.0, 0.2, 0.4, 0.6, 0.8]
    want = sum(awq_loss(x, [w], r.scales, sp) for w, sp in zip(ws, specs))
    assert r.loss == pytest.approx(want, rel=1e-9)


def test_search_numpy_torch_same_bits(torch):
    x, ws = salient_data(5, outs=(64, 64))
    for gram in (True, False):
        a = awq_search(x, ws, U4G64, gram=gram)
        b = awq_search(torch.from_numpy(x), [torch.from_numpy(w) for w in ws], U4G64, gram=gram)
        assert isinstance(b.scales, torch.Tensor) and a.ratio == b.ratio
        np.testing.assert_array_equal(a.scales.view(np.uint32), b.scales.numpy().view(np.uint32))
        assert a.loss == pytest.approx(b.loss, rel=1e-12)
        for (_, la), (_, lb) in zip(a.losses, b.losses):  # non-finalists: float32-product screened losses
            assert la == pytest.approx(lb, rel=1e-5)


def test_search_takes_bfloat16_tensors(torch):
    x, ws = salient_data(6)
    xb = torch.from_numpy(x).to(torch.bfloat16)
    wb = torch.from_numpy(ws[0]).to(torch.bfloat16)
    r = awq_search(xb, wb, U4G64)
    ref = awq_search(xb.float().numpy(), wb.float().numpy(), U4G64)
    assert r.ratio == ref.ratio and np.array_equal(r.scales.numpy(), ref.scales)


# ---- clipping search --------------------------------------------------------------------------------------------


def clip_transcription(x, w, spec_size, grid=20, max_shrink=0.5, n_tokens=512):
    """Quark's _compute_best_clip, written with loops over rows and groups (one group at a time quantized with
    the same element rule: uint4 asymmetric over the group alone)."""
    step = x.shape[0] // min(x.shape[0], n_tokens)
    xs = x[::step].astype(np.float64)
    out = w.copy()
    g_spec = qcore.make_spec("uint4", granularity=qcore.PerTensor())
    for r in range(w.shape[0]):
        for a in range(0, w.shape[1], spec_size):
            g = w[r, a:a + spec_size]
            xg = xs[:, a:a + spec_size]
            amax = np.abs(g).max()
            best, best_err = None, None
            for k in range(int(max_shrink * grid)):
                mv = amax * np.float32(1 - k / grid)
                q = qcore.fake_quantize(np.clip(g, -mv, mv), g_spec).astype(np.float64)
                err = np.mean((xg @ (q - g.astype(np.float64))) ** 2)
                if best_err is None or err < best_err:
                    best, best_err = mv, err
            out[r, a:a + spec_size] = np.clip(g, -best, best)
    return out


def test_clip_equals_a_transcription_and_lowers_error():
    x, (w,) = salient_data(7, t=600, n=128, outs=(24,))
    c = awq_clip(x, w, U4G64)
    assert c.dtype == np.float32 and c.shape == w.shape
    np.testing.assert_array_equal(c, clip_transcription(x, w, 64))
    assert not np.array_equal(c, w)
    xs = x[::1]
    before = out_error(xs, w, qcore.fake_quantize(w, U4G64).astype(np.float64))
    after = out_error(xs, w, qcore.fake_quantize(c, U4G64).astype(np.float64))
    assert after < 0.95 * before, (after, before)


def test_clip_never_worse_per_group_and_short_groups():
    x, (w,) = salient_data(8, t=300, n=96, outs=(40,))  # 96 = 64 + a short group of 32
    c = awq_clip(x, w, U4G64, n_tokens=None)
    q0 = qcore.fake_quantize(w, U4G64).astype(np.float64) - w
    q1 = qcore.fake_quantize(c, U4G64).astype(np.float64) - w
    x64 = x.astype(np.float64)
    for a, b in ((0, 64), (64, 96)):
        e0 = np.mean((x64[:, a:b] @ q0[:, a:b].T) ** 2, axis=0)
        e1 = np.mean((x64[:, a:b] @ q1[:, a:b].T) ** 2, axis=0)
        assert np.all(e1 <= e0 * (1 + 1e-12))
    assert np.all(np.abs(c) <= np.abs(w))


def test_clip_per_channel_spec_and_paths_agree():
    x, (w,) = salient_data(9, t=200, n=80, outs=(16,))
    spec = qcore.make_spec("int4", axis=0)  # per output row: the whole row is one group
    a = awq_clip(x, w, spec, gram=True)
    b = awq_clip(x, w, spec, gram=False)
    np.testing.assert_array_equal(a, b)
    assert out_error(x, w, qcore.fake_quantize(a, spec).astype(np.float64)) <= \
        out_error(x, w, qcore.fake_quantize(w, spec).astype(np.float64))


def test_clip_token_sampling_is_quarks_stride():
    x, (w,) = salient_data(10, t=1100, n=64, outs=(8,))
    # 1100 // min(1100, 512) = 2: every 2nd token (550 of them)
    np.testing.assert_array_equal(awq_clip(x, w, U4G64), awq_clip(x[::2], w, U4G64, n_tokens=None))


def test_clip_numpy_torch_same_bits(torch):
    x, (w,) = salient_data(11, t=300, n=128, outs=(48,))
    for gram in (True, False):
        a = awq_clip(x, w, U4G64, gram=gram)
        b = awq_clip(torch.from_numpy(x), torch.from_numpy(w), U4G64, gram=gram)
        assert isinstance(b, torch.Tensor)
        np.testing.assert_array_equal(a.view(np.uint32), b.numpy().view(np.uint32))


def test_clip_ties_keep_the_unclipped_group():
    # No input reaches the second group: every clip ties at zero error there, and ratio 1 must be kept.
    x, (w,) = salient_data(14, t=64, n=128, outs=(8,))
    x[:, 64:] = 0.0
    c = awq_clip(x, w, U4G64)
    np.testing.assert_array_equal(c[:, 64:], w[:, 64:])
    assert not np.array_equal(c[:, :64], w[:, :64])


def test_clip_no_shrink_is_identity():
    x, (w,) = salient_data(12, t=64, n=64, outs=(8,))
    np.testing.assert_array_equal(awq_clip(x, w, U4G64, max_shrink=0.0), w)


# ---- argument checks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [qcore.make_spec("uint4"), qcore.make_spec("int8", axis=1),
                                  qcore.make_spec("int4", granularity=qcore.PerGroup(32, axis=0)),
                                  qcore.make_spec("int8", granularity=qcore.PerBlock((4, 4))), "nvfp4"])
def test_clip_rejects_specs_whose_groups_span_rows(spec):
    x, (w,) = salient_data(0, t=16, n=64, outs=(8,))
    with pytest.raises(ValueError, match="spec"):
        awq_clip(x, w, spec)


@pytest.mark.parametrize("kwargs, exc, match", [
    (dict(grid=0), ValueError, "grid must be >= 1"),
    (dict(grid=2.0), TypeError, "grid must be an int"),
    (dict(max_shrink=1.0), ValueError, r"max_shrink must be in \[0, 1\)"),
    (dict(n_tokens=0), ValueError, "n_tokens must be >= 1"),
    (dict(gram="yes"), TypeError, "gram must be"),
])
def test_clip_rejects_options(kwargs, exc, match):
    x, (w,) = salient_data(0, t=16, n=64, outs=(8,))
    with pytest.raises(exc, match=match):
        awq_clip(x, w, U4G64, **kwargs)


def test_search_rejects_bad_arguments(torch):
    x, ws = salient_data(0, t=16, n=64, outs=(8, 8))
    with pytest.raises(ValueError, match=r"weights\[1\] has shape \(8, 63\)"):
        awq_search(x, [ws[0], ws[1][:, :63]], U4G64)
    with pytest.raises(TypeError, match=r"weights\[0\] must be the same array kind as x"):
        awq_search(x, [torch.from_numpy(ws[0])], U4G64)
    with pytest.raises(ValueError, match="x must be a 2-D"):
        awq_search(x[None], ws, U4G64)
    with pytest.raises(TypeError, match="x must be a numpy array or a torch tensor"):
        awq_search(x.tolist(), ws, U4G64)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        awq_search(x.astype(np.int32), ws, U4G64)
    bad = ws[0].copy()
    bad[0, 0] = np.inf
    with pytest.raises(ValueError, match=r"weights\[0\] must be finite"):
        awq_search(x, [bad], U4G64)
    with pytest.raises(ValueError, match="spec must be one spec or a sequence"):
        awq_search(x, ws, [U4G64])
    with pytest.raises(TypeError, match="spec must be a qcore.QuantSpec"):
        awq_search(x, ws, None)
    with pytest.raises(ValueError, match="key"):
        awq_search(x, ws, qcore.make_spec(U4G64, rounding=qcore.RoundingMode.STOCHASTIC))
    with pytest.raises(ValueError, match="grid must be >= 1"):
        awq_search(x, ws, U4G64, grid=0)
    with pytest.raises(ValueError, match="x must not be empty"):
        awq_search(x[:0], ws, U4G64)


def test_stochastic_rounding_with_a_key_is_deterministic():
    x, ws = salient_data(13, t=64, n=64, outs=(16,))
    spec = qcore.make_spec(U4G64, rounding=qcore.RoundingMode.STOCHASTIC)
    a = awq_search(x, ws, spec, key=7, grid=4)
    b = awq_search(x, ws, spec, key=7, grid=4)
    assert a.losses == b.losses
    np.testing.assert_array_equal(awq_clip(x, ws[0], spec, key=3), awq_clip(x, ws[0], spec, key=3))

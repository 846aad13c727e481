"""Quantization-aware distillation's pure parts (qcore.algorithms.distill) and its config (DistillConfig).

The losses are checked against a direct float64 transcription of their definitions (Hinton et al. 2015 for the
temperature-scaled KL; the Jensen-Shannon divergence as Quark's kd_jsd_loss defines it), written with plain
loops over tokens and vocabulary below, and the KL's gradient against its closed form T (softmax(s/T) -
softmax(t/T)) / tokens.
"""

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from qcore.algorithms.config import DistillConfig, parse_algorithm, parse_algorithms  # noqa: E402
from qcore.algorithms.distill import data_order, distill_loss, js_divergence, kl_divergence  # noqa: E402


def _softmax(row, T):
    m = max(row)
    e = [math.exp((x - m) / T) for x in row]
    z = sum(e)
    return [v / z for v in e]


def _reference_kl(s, t, T, mask=None):
    """mean over tokens of T^2 sum_v p_v log(p_v / q_v), p = softmax(t/T), q = softmax(s/T) (float64 lists)."""
    tot, n = 0.0, 0
    for i, (srow, trow) in enumerate(zip(s, t)):
        if mask is not None and not mask[i]:
            continue
        p, q = _softmax(trow, T), _softmax(srow, T)
        tot += sum(pv * math.log(pv / qv) for pv, qv in zip(p, q)) * T * T
        n += 1
    return tot / n


def _reference_jsd(s, t, T, beta):
    tot = 0.0
    for srow, trow in zip(s, t):
        p, q = _softmax(trow, T), _softmax(srow, T)
        m = [beta * a + (1 - beta) * b for a, b in zip(p, q)]
        tot += (beta * sum(a * math.log(a / c) for a, c in zip(p, m))
                + (1 - beta) * sum(b * math.log(b / c) for b, c in zip(q, m))) * T * T
    return tot / len(s)


def _logits(seed, shape=(2, 3, 11), scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale


@pytest.mark.parametrize("T", [1.0, 2.0, 0.5])
def test_kl_matches_the_float64_transcription_and_its_gradient_the_closed_form(T):
    s, t = _logits(0).requires_grad_(True), _logits(1)
    got = kl_divergence(s, t, temperature=T)
    ref = _reference_kl(s.detach().reshape(-1, 11).tolist(), t.reshape(-1, 11).tolist(), T)
    assert got.dtype == torch.float64 and abs(got.item() - ref) < 1e-12 * max(1.0, abs(ref))
    got.backward()
    n = s.shape[0] * s.shape[1]
    closed = T * (torch.softmax(s.detach() / T, -1) - torch.softmax(t / T, -1)) / n
    torch.testing.assert_close(s.grad, closed, rtol=1e-12, atol=1e-14)
    assert float(kl_divergence(t, t, temperature=T)) == pytest.approx(0.0, abs=1e-14)  # zero at the teacher


def test_kl_mask_float32_and_huge_logits():
    s, t = _logits(2), _logits(3)
    mask = torch.tensor([[1, 0, 1], [1, 1, 0]])
    ref = _reference_kl(s.reshape(-1, 11).tolist(), t.reshape(-1, 11).tolist(), 1.0, mask.reshape(-1).tolist())
    assert float(kl_divergence(s, t, mask=mask)) == pytest.approx(ref, rel=1e-12)
    assert float(kl_divergence(s.float(), t.float(), mask=mask)) == pytest.approx(ref, rel=1e-5)
    big = kl_divergence(s.float() * 1e4, t.float() * 1e4)  # no overflow: log_softmax
    assert torch.isfinite(big)


def test_jsd_matches_the_transcription_and_is_symmetric_at_half():
    s, t = _logits(4), _logits(5)
    for beta, T in ((0.5, 1.0), (0.3, 2.0)):
        ref = _reference_jsd(s.reshape(-1, 11).tolist(), t.reshape(-1, 11).tolist(), T, beta)
        assert float(js_divergence(s, t, temperature=T, beta=beta)) == pytest.approx(ref, rel=1e-12)
    assert float(js_divergence(s, t)) == pytest.approx(float(js_divergence(t, s)), rel=1e-12)


def test_distill_loss_blends_kd_and_next_token_cross_entropy():
    s, t = _logits(6), _logits(7)
    labels = torch.randint(0, 11, (2, 3), generator=torch.Generator().manual_seed(0))
    ce = sum(-math.log(_softmax(s[b, i].tolist(), 1.0)[labels[b, i + 1]]) for b in range(2) for i in range(2)) / 4
    kd = _reference_kl(s.reshape(-1, 11).tolist(), t.reshape(-1, 11).tolist(), 1.0)
    got = distill_loss(s, t, alpha=0.25, labels=labels)
    assert float(got) == pytest.approx(0.25 * kd + 0.75 * ce, rel=1e-12)
    assert float(distill_loss(s, t)) == pytest.approx(kd, rel=1e-12)
    with pytest.raises(ValueError, match="labels"):
        distill_loss(s, t, alpha=0.5)
    with pytest.raises(ValueError, match="loss must be one of"):
        distill_loss(s, t, loss="mse")
    with pytest.raises(ValueError, match="same shape"):
        kl_divergence(s, t[..., :5])
    with pytest.raises(ValueError, match="temperature"):
        kl_divergence(s, t, temperature=0)


def test_data_order_is_epochs_of_permutations_and_follows_the_key():
    o = data_order(5, 12, key=3)
    assert len(o) == 12 and sorted(o[:5]) == list(range(5)) and sorted(o[5:10]) == list(range(5))
    assert np.array_equal(o, data_order(5, 12, key=3)) and not np.array_equal(o, data_order(5, 12, key=4))
    with pytest.raises(ValueError, match="n_batches"):
        data_order(0, 3)


def test_config_round_trips_and_reads_quarks_trainer_spelling():
    c = DistillConfig(steps=7, lr=2e-5, batch=2, loss="jsd", temperature=2.0, alpha=0.9, train_scales=True,
                      scale_lr=1e-4, optimizer="sgd", schedule="constant", max_seconds=60, eval_batches=1, key=5)
    assert parse_algorithm(c.to_dict()) == c and parse_algorithm("distill") == DistillConfig()
    q = c.to_quark()
    # QADTrainer(temperature=, kd_loss_type=, kd_alpha=) and TrainingArguments(learning_rate=, max_steps=,
    # per_device_train_batch_size=, weight_decay=): the names Quark 0.13's qad_trainer takes
    for k in ("kd_loss_type", "kd_alpha", "temperature", "learning_rate", "max_steps", "per_device_train_batch_size",
              "weight_decay"):
        assert k in q
    assert parse_algorithm(q) == c
    assert parse_algorithm({"name": "distill", "kd_loss_type": "kl", "kd_alpha": 1.0, "learning_rate": 1e-5,
                            "max_steps": 3}) == DistillConfig(steps=3)
    with pytest.raises(ValueError, match="both set"):
        parse_algorithm({"name": "distill", "lr": 1e-5, "learning_rate": 1e-5})
    for bad in ({"loss": "mse"}, {"steps": 0}, {"lr": 0.0}, {"alpha": 1.5}, {"optimizer": "adam"}):
        with pytest.raises(ValueError):
            DistillConfig(**bad)
    with pytest.raises(TypeError):
        DistillConfig(train_scales=1)


def test_distill_must_come_last():
    assert [a.name for a in parse_algorithms("quarot,gptq,distill")] == ["quarot", "gptq", "distill"]
    with pytest.raises(ValueError, match="must come last"):
        parse_algorithms("distill,gptq")
    with pytest.raises(ValueError, match="must come last"):
        parse_algorithms("gptq,distill,distill")

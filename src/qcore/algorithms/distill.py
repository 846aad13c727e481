"""Quantization-aware distillation (QAD): the losses and the data order, as pure functions on torch tensors.

The quantized model (the student: fake-quantized weights with straight-through gradients) is trained to match the
float model (the teacher) token by token: the loss is the Kullback-Leibler divergence of the student's next-token
distribution from the teacher's (Hinton et al. 2015, "Distilling the knowledge in a neural network"; the recipe of
NVIDIA Model-Optimizer's QAD and AMD Quark's ``QADTrainer``), optionally blended with the ordinary next-token cross
entropy. ``qcore.adapters.passes.distill`` runs the training on a whole model.

With temperature ``T``, ``p = softmax(t / T)`` (teacher) and ``q = softmax(s / T)`` (student), per token

    KL(p || q) = sum_v p_v (log p_v - log q_v)                      (times T**2, Hinton's gradient scale)

and its gradient with respect to the student logits is ``T * (q - p)`` (``(q - p)`` at ``T = 1``). The
Jensen-Shannon variant (``loss="jsd"``, Quark's ``kd_jsd_loss``) is ``beta KL(p || m) + (1 - beta) KL(q || m)``
with ``m = beta p + (1 - beta) q``. Both are computed from ``log_softmax`` (no overflow for any finite logits) in
float32 at least, and averaged over the tokens that count (``mask``).

Torch is imported only when these functions are called with torch tensors (``import qcore`` never imports torch).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["kl_divergence", "js_divergence", "distill_loss", "data_order", "LOSSES"]

LOSSES = ("kl", "jsd")


def _check_logits(student: Any, teacher: Any) -> tuple:
    import torch
    for name, t in (("student_logits", student), ("teacher_logits", teacher)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point() or t.dim() < 1:
            raise ValueError(f"{name} must be floating-point logits [..., vocab], got {t.dtype} {tuple(t.shape)}")
    if student.shape != teacher.shape:
        raise ValueError(f"student_logits {tuple(student.shape)} and teacher_logits {tuple(teacher.shape)} must have "
                         f"the same shape [..., vocab]")
    dt = torch.promote_types(torch.promote_types(student.dtype, teacher.dtype), torch.float32)
    return student.reshape(-1, student.shape[-1]).to(dt), teacher.reshape(-1, teacher.shape[-1]).to(dt)


def _check_temperature(temperature: Any) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature > 0 \
            or not np.isfinite(temperature):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _mean(per_token: Any, mask: Any, shape: tuple) -> Any:
    import torch
    if mask is None:
        return per_token.mean()
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(shape[:-1]):
        raise ValueError(f"mask must be a tensor of the logits' leading shape {tuple(shape[:-1])}, got "
                         f"{tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")
    m = mask.reshape(-1).to(per_token.dtype)
    n = m.sum()
    if n.item() == 0:
        raise ValueError("mask selects no token")
    return (per_token * m).sum() / n


def kl_divergence(student_logits: Any, teacher_logits: Any, *, temperature: float = 1.0, mask: Any = None) -> Any:
    """Mean over tokens of ``KL(softmax(teacher / T) || softmax(student / T)) * T**2`` (a 0-d tensor; gradients flow
    to ``student_logits``). Logits ``[..., vocab]`` of the same shape; ``mask`` (optional, ``[...]``): the tokens
    that count. Computed in float32 (float64 inputs stay float64)."""
    T = _check_temperature(temperature)
    s, t = _check_logits(student_logits, teacher_logits)
    import torch
    ls = torch.log_softmax(s / T, dim=-1)
    lt = torch.log_softmax(t / T, dim=-1)
    per = (lt.exp() * (lt - ls)).sum(-1)
    return _mean(per, mask, tuple(student_logits.shape)) * (T * T)


def js_divergence(student_logits: Any, teacher_logits: Any, *, temperature: float = 1.0, beta: float = 0.5,
                  mask: Any = None) -> Any:
    """Mean over tokens of ``beta KL(p || m) + (1 - beta) KL(q || m)``, ``m = beta p + (1 - beta) q``, with
    ``p``/``q`` the teacher/student distributions at temperature ``T``, times ``T**2``. ``beta`` in (0, 1)."""
    T = _check_temperature(temperature)
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0 < beta < 1:
        raise ValueError(f"beta must be a number in (0, 1), got {beta!r}")
    s, t = _check_logits(student_logits, teacher_logits)
    import math

    import torch
    ls = torch.log_softmax(s / T, dim=-1)
    lt = torch.log_softmax(t / T, dim=-1)
    lm = torch.logsumexp(torch.stack([lt + math.log(beta), ls + math.log(1 - beta)]), dim=0)  # log m, stable
    per = beta * (lt.exp() * (lt - lm)).sum(-1) + (1 - beta) * (ls.exp() * (ls - lm)).sum(-1)
    return _mean(per, mask, tuple(student_logits.shape)) * (T * T)


def distill_loss(student_logits: Any, teacher_logits: Any, *, loss: str = "kl", temperature: float = 1.0,
                 alpha: float = 1.0, labels: Any = None, mask: Any = None) -> Any:
    """``alpha * KD + (1 - alpha) * CE``: KD = ``kl_divergence`` or ``js_divergence`` (``loss``), CE = the mean
    next-token cross entropy of the student against ``labels`` (token ids ``[...]``, the logits' leading shape;
    position ``i`` predicts ``labels[..., i + 1]``), needed when ``alpha < 1``."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {LOSSES}, got {loss!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if alpha < 1 and labels is None:
        raise ValueError(f"alpha={alpha} blends in the cross entropy, which needs labels (token ids)")
    fn = kl_divergence if loss == "kl" else js_divergence
    kd = fn(student_logits, teacher_logits, temperature=temperature, mask=mask) if alpha > 0 else None
    if alpha == 1:
        return kd
    import torch
    if tuple(labels.shape) != tuple(student_logits.shape[:-1]) or student_logits.dim() < 2:
        raise ValueError(f"labels {tuple(labels.shape)} must have the logits' leading shape "
                         f"{tuple(student_logits.shape[:-1])} (with a sequence axis)")
    s = student_logits[..., :-1, :].reshape(-1, student_logits.shape[-1])
    s = s.to(torch.promote_types(s.dtype, torch.float32))
    y = labels[..., 1:].reshape(-1)
    if mask is not None:
        keep = mask[..., 1:].reshape(-1).bool()
        s, y = s[keep], y[keep]
    ce = torch.nn.functional.cross_entropy(s, y)
    return ce * (1 - alpha) if kd is None else alpha * kd + (1 - alpha) * ce


def data_order(n_batches: int, n_draws: int, *, key: int = 0) -> np.ndarray:
    """The batch indices ``n_draws`` training draws use: epochs over ``range(n_batches)``, each a fresh
    permutation from ``numpy.random.default_rng(key)`` (every batch once per epoch; the same key, the same order)."""
    for name, v in (("n_batches", n_batches), ("n_draws", n_draws)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if isinstance(key, bool) or not isinstance(key, (int, np.integer)):
        raise TypeError(f"key must be an int, got {key!r}")
    rng = np.random.default_rng(int(key))
    epochs = -(-int(n_draws) // int(n_batches))
    return np.concatenate([rng.permutation(int(n_batches)) for _ in range(epochs)])[:n_draws]

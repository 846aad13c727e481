"""Quantization-aware distillation on a whole quantized model (``DistillConfig``; the losses are
``qcore.algorithms.distill``).

``quantize_model`` runs it last: after the rotation, the layer algorithms (GPTQ, ...), the commit of the weights
and the calibration of static activation scales. The teacher is a copy of the float model taken before any of
them (a rotation does not change the float model's function, so it is also the rotated float model's teacher).

What is trained: the weight of every quantized module, through the fake quantization with the module's committed scales held FIXED and
straight-through gradients (``qcore.fake_quantize``); with ``train_scales`` also those scales (float32 scales
of integer formats: the learned-step-size gradient of Esser et al. 2019, "LSQ"). Everything else (embeddings,
norms, a float output head, biases, static activation scales) stays as it is; a weight tied between quantized
modules is one trained tensor. The trained (latent) weight starts where the weight was rounded from: for a
weight round-to-nearest quantized, the float weight itself (so a weight near a rounding boundary flips code after
a small step, as in ordinary quantization-aware training; the model at step 0 is the round-to-nearest one); for a
weight an algorithm decided (GPTQ's pinned codes), its committed on-grid values (GPTQ's decisions are the start;
a code changes once the weight has moved half a grid step). At the end each trained weight is rounded once more with its (fixed or trained)
scales and written in place with them, so the module's weight lies on the grid of its stored scales: the
exported checkpoint (``export_hf``) holds exactly the codes the trained fake-quantized model computes with.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

import torch
from torch import nn

import qcore
from qcore.algorithms.distill import data_order, distill_loss

from ..batches import FoundState, call_model, progress_bar, to_device, logits_of
from ..modules import QuantExperts, QuantModule
from .targets import check_experts_algorithms

_log = logging.getLogger("qcore.adapters")

__all__ = ["check_distill", "run_distill", "make_teacher"]


def _targets(model: nn.Module) -> list:
    """``[(name, module)]`` of the quantized modules with a quantized weight, in model order."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, QuantModule) and "weight" in m.specs]


def _scale_trainable(spec) -> Optional[str]:
    """Why the scales of ``spec`` cannot be trained (None when they can)."""
    if not isinstance(spec.dtype, qcore.dtypes.IntDType):
        return f"{spec.name or spec.dtype.name}: not an integer format"
    if spec.scale_dtype.name != "float32" or spec.pow2_scale:
        return f"{spec.name or spec.dtype.name}: its scales are {spec.scale_dtype.name}, not free float32 values"
    if spec.two_level:
        return f"{spec.name or spec.dtype.name}: two-level scales"
    return None


def check_distill(model: nn.Module, plans: list, algo) -> None:
    """Before any work: ValueError for what the distillation cannot train (fused MoE experts; ``train_scales``
    with weight formats whose scales are not free float32 values, e.g. MXFP4's E8M0 powers of two)."""
    check_experts_algorithms(plans, [algo])
    with_weight = [p for p in plans if p.config.weight is not None]
    if not with_weight:
        raise ValueError("distill: the config quantizes no weight; there is nothing to train")
    if algo.train_scales:
        bad = sorted({why for p in with_weight if (why := _scale_trainable(p.config.weight.spec)) is not None})
        if bad:
            raise ValueError(f"distill: train_scales=True but the weight scales cannot be trained ({'; '.join(bad)}); "
                             f"use train_scales=False (the weights are trained with the scales fixed)")


def make_teacher(model: nn.Module) -> nn.Module:
    """A frozen float copy of ``model`` (eval mode, no gradients)."""
    import copy
    teacher = copy.deepcopy(model)
    teacher.eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def _logits(out) -> torch.Tensor:
    return logits_of(out, missing="distill: the model's output ({type}) has no logits; distillation needs a model "
                                  "returning logits (a causal LM)")


def _ids_and_mask(batch: Any) -> tuple:
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, dict):
        return batch.get("input_ids"), batch.get("attention_mask")
    return (batch[0] if batch and isinstance(batch[0], torch.Tensor) else None), None


class _Trainee:
    """One trained weight (shared by the modules tied to it) with its fixed scales and, optionally, a trained
    scale tensor."""

    def __init__(self, mods: list, train_scales: bool):
        self.mods = mods
        m = mods[0]
        self.weight = m.weight
        self.spec = m.specs["weight"]
        b = m._buffers
        self.scale = b["weight_scale"].detach().clone()
        self.zero = b.get("weight_zero_point")
        self.zero = None if self.zero is None else self.zero.detach().clone()
        self.tscale = b.get("weight_tensor_scale")
        self.tscale = None if self.tscale is None else self.tscale.detach().clone()
        self.train_scale = nn.Parameter(self.scale.clone()) if train_scales else None

    def kw(self, scale: torch.Tensor) -> dict:
        kw: dict = {"scale": scale}
        if self.zero is not None:
            kw["zero_point"] = self.zero
        if self.tscale is not None:
            kw["tensor_scale"] = self.tscale
        return kw

    def fake(self, m: QuantModule) -> torch.Tensor:
        """The weight the forward uses: fake-quantized with the scales, straight-through to the weight (and the
        LSQ gradient to a trained scale)."""
        w = m.to_canonical(self.weight)
        wf = w.float()
        if self.train_scale is None:
            fq = qcore.fake_quantize(wf, self.spec, **self.kw(self.scale))
        else:
            s = self.train_scale
            sd = s.detach()
            fq = qcore.fake_quantize(wf, self.spec, **self.kw(sd))
            se = _expand(s, wf.shape)
            with torch.no_grad():
                sde = se.detach()
                z = 0.0 if self.zero is None else _expand(self.zero, wf.shape)
                u = wf.detach() / sde + z  # the code before rounding and clamping
                lo, hi = float(self.spec.dtype.min), float(self.spec.dtype.max)
                inside = ((u >= lo - 0.5) & (u <= hi + 0.5)).to(wf.dtype)
                g = (fq.detach() / sde) - inside * (wf.detach() / sde)  # d fq / d s: (q - z) - [inside] w / s
            fq = fq + (se - sde) * g
        return m.from_canonical(fq).to(self.weight.dtype)

    @torch.no_grad()
    def write(self) -> None:
        """Round the weight once more with its final scales and write it (and the scales) in place."""
        scale = self.scale if self.train_scale is None else self.train_scale.detach().clone()
        m0 = self.mods[0]
        q = qcore.quantize(m0.to_canonical(self.weight).detach().float(), self.spec, **self.kw(scale))
        for m in self.mods:  # tied modules share the tensor: each keeps the scales
            m.replace_weight(q)


def _expand(s: torch.Tensor, shape: tuple) -> torch.Tensor:
    """A per-channel / per-group scale tensor broadcast to the weight's canonical shape."""
    out = s
    for d, (n, k) in enumerate(zip(shape, s.shape)):
        if k != n:
            r = -(-n // k)
            out = out.repeat_interleave(r, dim=d).narrow(d, 0, n)
    return out


def _lr_at(algo, step: int, seconds: float) -> float:
    """The learning-rate factor: cosine from 1 to 0 over the training, whose progress is the larger of the steps'
    and (with ``max_seconds``) the wall clock's share."""
    if algo.schedule == "constant":
        return 1.0
    done = step / algo.steps
    if algo.max_seconds is not None:
        done = max(done, seconds / algo.max_seconds)
    return 0.5 * (1.0 + math.cos(math.pi * min(done, 1.0)))


def run_distill(model: nn.Module, teacher: nn.Module, data: list, algo, *, progress: bool = True,
                init: Optional[dict] = None) -> dict:
    """Train ``model`` (quantized, weights committed) against ``teacher`` (its float original) on ``data`` per
    ``algo`` (``DistillConfig``); returns ``{"steps", "tokens", "seconds", "loss_first", "loss_last",
    "eval_before", "eval_after"}`` (``eval_*``: the mean loss over the first ``eval_batches`` batches, None
    without). The weights are written (on the grid of their stored scales) at the end, also when interrupted.
    ``init``: ``{module name: the float weight its committed value was rounded to nearest from}``: the trained
    weight starts there (it rounds to the committed value with the stored scales)."""

    if not data:
        raise ValueError("distill: the calibration data is empty; distillation trains on it")
    if algo.eval_batches > len(data):
        raise ValueError(f"distill: eval_batches={algo.eval_batches} but there are {len(data)} batches")
    groups: dict = {}
    starts: dict = {}
    for name, m in _targets(model):
        if init is not None and name in init:
            starts.setdefault(id(m.weight), init[name])
        if isinstance(m, QuantExperts):
            raise ValueError(f"distill: {m.qname!r} is fused MoE experts, which distillation does not train yet")
        groups.setdefault(id(m.weight), []).append(m)
    trainees = [_Trainee(ms, algo.train_scales) for ms in groups.values()]
    with torch.no_grad():
        for k, tr in zip(groups, trainees):
            if k in starts:
                tr.weight.copy_(starts[k].to(tr.weight.device, tr.weight.dtype))
    device = next(model.parameters()).device
    req = {p: p.requires_grad for p in model.parameters()}
    found = FoundState(model, hooks=False)  # modes and requires_grad

    def loss_of(batch) -> torch.Tensor:
        b = to_device(batch, device)
        with torch.no_grad():
            t = _logits(call_model(teacher, b))
        s = _logits(call_model(model, b))
        ids, mask = _ids_and_mask(b)
        return distill_loss(s, t, loss=algo.loss, temperature=algo.temperature, alpha=algo.alpha,
                            labels=ids if algo.alpha < 1 else None, mask=mask)

    def evaluate() -> Optional[float]:
        if not algo.eval_batches:
            return None
        with torch.no_grad():
            return sum(float(loss_of(data[i])) for i in range(algo.eval_batches)) / algo.eval_batches

    stats: dict = {"steps": 0, "tokens": 0, "seconds": 0.0, "loss_first": None, "loss_last": None}
    for p in model.parameters():
        p.requires_grad_(False)
    for tr in trainees:
        tr.weight.requires_grad_(True)
        for m in tr.mods:
            object.__setattr__(m, "_w", (lambda tr=tr, m=m: tr.fake(m)))  # the forward's weight (an instance attr)
    try:
        model.eval()  # dropout off: the student sees what the teacher sees
        stats["eval_before"] = evaluate()
        params = [{"params": [tr.weight for tr in trainees], "lr": algo.lr}]
        if algo.train_scales:
            params.append({"params": [tr.train_scale for tr in trainees], "lr": algo.scale_lr or algo.lr,
                           "weight_decay": 0.0})
        if algo.optimizer == "adamw":
            opt = torch.optim.AdamW(params, lr=algo.lr, weight_decay=algo.weight_decay)
        else:
            opt = torch.optim.SGD(params, lr=algo.lr, weight_decay=algo.weight_decay)
        base = [g["lr"] for g in opt.param_groups]
        order = data_order(len(data), algo.steps * algo.batch, key=algo.key)
        start = time.perf_counter()
        bar = progress_bar(range(algo.steps), total=algo.steps, desc="distilling", enabled=progress)
        for step in bar:
            f = _lr_at(algo, step, time.perf_counter() - start)
            for g, b0 in zip(opt.param_groups, base):
                g["lr"] = b0 * f
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for j in range(algo.batch):
                batch = data[int(order[step * algo.batch + j])]
                loss = loss_of(batch)
                if not torch.isfinite(loss):
                    raise FloatingPointError(f"distill: the loss is {float(loss)} at step {step}")
                (loss / algo.batch).backward()
                total += float(loss.detach()) / algo.batch
                ids, _ = _ids_and_mask(batch)
                stats["tokens"] += int(ids.numel()) if ids is not None else 0
            opt.step()
            if algo.train_scales:
                with torch.no_grad():
                    for tr in trainees:
                        tr.train_scale.clamp_(min=torch.finfo(torch.float32).tiny)
            stats["steps"] = step + 1
            stats["loss_first"] = total if stats["loss_first"] is None else stats["loss_first"]
            stats["loss_last"] = total
            stats["seconds"] = time.perf_counter() - start
            if hasattr(bar, "set_postfix"):
                bar.set_postfix(loss=f"{total:.4f}")
            if step % 10 == 0 or step + 1 == algo.steps:
                _log.info("distill step %d/%d: loss %.5f (%.0f s)", step + 1, algo.steps, total, stats["seconds"])
            if algo.max_seconds is not None and stats["seconds"] >= algo.max_seconds:
                _log.info("distill: stopped after %d steps at max_seconds=%s", step + 1, algo.max_seconds)
                break
    finally:
        for tr in trainees:
            for m in tr.mods:
                m.__dict__.pop("_w", None)
            tr.write()  # on the grid of the stored scales, also after an interruption
        for p, r in req.items():
            p.requires_grad_(r)
        found.restore()
    stats["eval_after"] = evaluate()
    return stats

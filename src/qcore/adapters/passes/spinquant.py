"""SpinQuant (Liu et al. 2024): learn the residual rotation R1 and the per-head rotations R2 of QuaRot
(``qcore.adapters.passes.rotation``) by Cayley SGD on the orthogonal group, minimising the next-token loss of the
fake-quantized model.

``spinquant(model, plans, data, algo, *, progress=False)`` (reached through ``quantize_model`` with the algorithm
``{"name": "spinquant"}``, or ``apply_rotation``):

1. the norms are folded and the head untied as in ``rotate_model``; the online Hadamard hooks (``algo.online``)
   are installed; R1 starts at QuaRot's ``rotation(hidden, key=key)``, each layer's R2 at ``rotation(head_dim,
   key=key + 1)``;
2. each step takes ``algo.batch`` calibration sequences (cycling through ``data``), computes the rotated weights
   from the float weights (``rotated_weights``, float32), fake-quantizes every planned weight with its spec
   (round to nearest, straight-through gradient; only when ``train_weights``: not when GPTQ rounds the
   weights afterwards, by default) and every planned Linear's input with its spec (dynamic
   scales, even where the config calibrates static ones: the rotation is trained for the format, the scales
   are calibrated after), and back-propagates the causal-LM loss to R1 and R2 only;
3. ``qcore.algorithms.orthogonal.cayley_step`` moves each rotation along its Riemannian gradient (in float64), so
   it stays orthogonal;
4. the learnt rotations are fused into the weights (float64 arithmetic), as ``rotate_model`` does.

The float model computes the same function afterwards (every rotation is orthogonal); only its quantization
changes. Cost per step: one forward and backward of the model with fake quantization (SmolLM2-135M, one
512-token sequence: a few seconds on 2 CPU cores). Output quantization and the KV cache are not modelled.
"""

from __future__ import annotations

import logging
import time
from typing import Mapping, Optional, Sequence

import torch
from torch import nn
from torch.func import functional_call

import qcore
from qcore.algorithms.config import SpinQuantConfig
from qcore.algorithms.hadamard import rotation
from qcore.algorithms.orthogonal import cayley_step

from ..batches import FoundState, progress_bar
from ..modules import (InputRotation, ReferenceInputRotation, activation_granularity, linear_weight_spec, online_hooks,
                       remove_online, with_granularity)
from ..families import family_of
from .rotation import (check_rotation, fold_norms_and_untie, rotate_model, rotated_weights, rotation_parts,
                       times_online, write_weights)

__all__ = ["spinquant", "apply_rotation"]

_log = logging.getLogger("qcore.adapters")


def _ids(batch, i: int) -> torch.Tensor:
    if isinstance(batch, torch.Tensor):
        ids = batch
    elif isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
    else:
        raise ValueError(f"spinquant: calibration batch {i} must be a token-id tensor or a dict with 'input_ids', "
                         f"got {type(batch).__name__}")
    if ids.dim() == 1:
        ids = ids[None]
    if ids.dim() != 2 or ids.dtype not in (torch.int32, torch.int64) or ids.shape[1] < 2:
        raise ValueError(f"spinquant: calibration batch {i} must hold token ids [batch, seq >= 2], got "
                         f"{tuple(ids.shape)} {ids.dtype}")
    return ids


def _specs(model: nn.Module, plans: Sequence) -> tuple[dict, dict]:
    wspecs, aspecs = {}, {}
    for p in plans:
        m = model.get_submodule(p.name)
        if not isinstance(m, nn.Linear):
            continue
        if p.config.weight is not None:
            wspecs[f"{p.name}.weight"] = linear_weight_spec(m, p, p.name)
        if p.config.input is not None:
            spec = p.config.input.spec
            aspecs[p.name] = with_granularity(spec, activation_granularity(spec.granularity, False))
    return wspecs, aspecs


def _act_hook(spec, last: Optional[list] = None):
    """A pre-hook fake-quantizing a Linear's input with ``spec``. ``last`` (a list shared by the hooks of one model,
    fast path): ``[input, spec, output]`` of the latest call, reused when the next Linear reads the same tensor with
    an equal spec (q, k, v; gate, up): the same values, computed once."""
    def hook(mod, args):
        x = args[0]
        if last is not None and last[0] is x and last[1] == spec:
            return (last[2],) + tuple(args[1:])
        y = qcore.fake_quantize(x.reshape(-1, x.shape[-1]).float(), spec).reshape(x.shape).to(x.dtype)
        if last is not None:
            last[:] = [x, spec, y]
        return (y,) + tuple(args[1:])
    return hook


def spinquant(model: nn.Module, plans: Sequence, data: Optional[Sequence], algo, *, progress: bool = False,
              train_weights: bool = True) -> nn.Module:
    """Learn and fuse SpinQuant's rotations into ``model`` in place (module docstring); returns it."""
    return _spinquant(model, plans, data, algo, progress=progress, train_weights=train_weights, reference=False)


def _reference_spinquant(model: nn.Module, plans: Sequence, data: Optional[Sequence], algo, *,
                         progress: bool = False, train_weights: bool = True) -> nn.Module:
    """The landed SpinQuant step (issue 11), kept as the reference the fast one is tested against (within the float
    tolerance ``docs/rotations.md`` states): every rotated weight from the float weights each step (the embedding
    and the head included), each online weight times its dense ``Q`` each step, and the online transforms
    differentiated through their elementwise graph."""
    return _spinquant(model, plans, data, algo, progress=progress, train_weights=train_weights, reference=True)


class _Step:
    """What one fast step needs besides the rotations (issue 23). Computed once:

    - ``start``: each online weight whose columns no learnt rotation touches (``mlp_out``; ``attn_out`` too without
      R2) times its constant ``Q`` (float32), so a step computes ``R1^T (W Q)``, not ``(R1^T W) Q``;
    - ``skip``: the embedding, whose output is rotated instead (``E[ids] R1``: the batch's rows, not the
      vocabulary's), and the head when it is neither weight- nor input-quantized in training (its input times
      ``R1^T``: ``x (W R1)^T = (x R1^T) W^T``).

    The same function as the reference step up to float rounding (a different association of the same
    products)."""

    def __init__(self, model, emb, head, qs: dict, wspecs: dict, aspecs: dict, heads: bool):
        names = {id(m): n for n, m in model.named_modules()}
        fam = family_of(model)
        r2_cols = {f"{n}.weight" for n, m in model.named_modules() if n.endswith("." + fam.attn_out)} if heads \
            else set()
        with torch.no_grad():
            self.start = {k: model.get_parameter(k).detach().float() @ q.float()
                          for k, q in qs.items() if k not in r2_cols}
        self.qs = {k: q for k, q in qs.items() if k in r2_cols}
        ek = f"{names[id(emb)]}.weight"
        hn = names[id(head)]
        self.skip = [ek]
        self.head_input = f"{hn}.weight" not in wspecs and hn not in aspecs
        if self.head_input:
            self.skip.append(f"{hn}.weight")
        self.r1 = None
        self.hooks = [emb.register_forward_hook(self._emb_out)]
        if self.head_input:
            self.hooks.append(head.register_forward_pre_hook(self._head_in))

    def _emb_out(self, mod, args, out):
        return (out.to(self.r1.dtype) @ self.r1).to(out.dtype)  # rotated in float32, back in the model dtype

    def _head_in(self, mod, args):
        x = args[0]
        return ((x.to(self.r1.dtype) @ self.r1.T).to(x.dtype),) + tuple(args[1:])

    def values(self, model, r1v, r2v) -> dict:
        self.r1 = r1v
        vals = rotated_weights(model, r1v, r2v, dtype=torch.float32, start=self.start, skip=self.skip)
        for k, w in self.start.items():  # r1 None: W Q as it is
            vals.setdefault(k, w)
        return times_online(model, vals, self.qs, torch.float32)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _as_reference(model) -> dict:
    """Swap every ``InputRotation`` hook for the landed one (``ReferenceInputRotation``); returns what to restore."""
    swapped = {}
    for m in model.modules():
        for k, h in list(m._forward_pre_hooks.items()):
            if type(h) is InputRotation:
                ref = ReferenceInputRotation(h.size, key=h.key)
                m._forward_pre_hooks[k] = ref
                swapped[(id(m), k)] = (m, k, h)
    return swapped


def _spinquant(model, plans, data, algo, *, progress: bool, train_weights: bool, reference: bool):
    emb, norm, head, layers, hd = rotation_parts(model)
    if not data:
        raise ValueError("spinquant trains its rotations on calibration data: pass a non-empty list of token-id "
                         "batches as data=")
    batches = [_ids(b, i) for i, b in enumerate(data)]
    wspecs, aspecs = _specs(model, plans)
    if not train_weights:
        wspecs = {}
    if not wspecs and not aspecs:
        raise ValueError("spinquant: the config quantizes none of the model's Linears; nothing to train for")
    dev = emb.weight.device
    key = algo.key
    r1 = torch.from_numpy(rotation(emb.weight.shape[1], key=key)).to(dev)
    r2 = [torch.from_numpy(rotation(hd, key=None if key is None else key + 1)).to(dev)
          for _ in layers] if algo.heads else None
    fold_norms_and_untie(model, emb, norm, head, layers)
    qs = online_hooks(model, algo.online, key)
    swapped = _as_reference(model) if reference else {}
    last = None if reference else [None, None, None]
    hooks = [model.get_submodule(n).register_forward_pre_hook(_act_hook(s, last)) for n, s in aspecs.items()]
    step_of = None
    found = FoundState(model, hooks=False)  # the online hooks stay (they are the result)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    dtypes = {n: p.dtype for n, p in model.named_parameters()}
    model.eval()
    t0 = time.perf_counter()
    losses, step_s = [], []
    try:
        for p in model.parameters():
            p.requires_grad_(False)
        if not reference:
            step_of = _Step(model, emb, head, qs, wspecs, aspecs, r2 is not None)
        for step in progress_bar(range(algo.steps), total=algo.steps, desc="spinquant", enabled=progress):
            ts = time.perf_counter()
            ids = torch.cat([batches[(step * algo.batch + j) % len(batches)] for j in range(algo.batch)]).to(dev)
            r1v = r1.float().requires_grad_()
            r2v = [r.float().requires_grad_() for r in r2] if r2 is not None else None
            if reference:
                vals = times_online(model, rotated_weights(model, r1v, r2v, dtype=torch.float32), qs, torch.float32)
            else:
                vals = step_of.values(model, r1v, r2v)
            for k, spec in wspecs.items():
                w = vals.get(k)
                if w is None:
                    w = model.get_parameter(k).float()
                vals[k] = qcore.fake_quantize(w, spec)
            # the rotations are computed in float32; the model runs in its own dtype (bfloat16 / float16 models:
            # cast back, as rotate_model writes its float64 products back; the gradient flows through the cast)
            vals = {k: v if v.dtype == dtypes[k] else v.to(dtypes[k]) for k, v in vals.items()}
            out = functional_call(model, vals, (ids,), {"labels": ids, "use_cache": False})
            loss = out.loss
            if not torch.isfinite(loss):
                raise ValueError(f"spinquant: the loss is {float(loss)} at step {step}; lower lr ({algo.lr})")
            loss.backward()
            losses.append(float(loss.detach()))
            del out, loss, vals
            if last is not None:
                last[:] = [None, None, None]  # the step's graph is not kept alive
            r1 = cayley_step(r1, r1v.grad.double(), lr=algo.lr)
            if r2 is not None:
                r2 = [cayley_step(r, g.grad.double(), lr=algo.lr) for r, g in zip(r2, r2v)]
            step_s.append(time.perf_counter() - ts)
    except BaseException:
        # the weights do not hold the online Q yet: without its hooks the (norm-folded) model computes the
        # original function again
        if step_of is not None:
            step_of.remove()
        remove_online(model)
        raise
    finally:
        for h in hooks:
            h.remove()
        for m, k, h in swapped.values():  # the model's own InputRotation objects back (unless removed above)
            if k in m._forward_pre_hooks:
                m._forward_pre_hooks[k] = h
        for n, p in model.named_parameters():
            p.requires_grad_(flags.get(n, True))
        found.restore()
    if step_of is not None:
        step_of.remove()
    with torch.no_grad():
        write_weights(model, times_online(model, rotated_weights(model, r1, r2), qs))
    model._qcore_spinquant_losses = losses  # the training curve (first, last: logged)
    model._qcore_spinquant_step_s = step_s  # seconds per step (bench/bench_rotation_speed.py)
    _log.info("spinquant: %d steps in %.1f s, loss %.4f -> %.4f", algo.steps, time.perf_counter() - t0,
              losses[0], losses[-1])
    return model


def apply_rotation(model: nn.Module, algo, *, plans: Sequence = (), data: Optional[Sequence] = None,
                   progress: bool = False, gptq_follows: bool = False) -> nn.Module:
    """Run a ``QuaRotConfig`` or ``SpinQuantConfig`` (``qcore.algorithms.config``) on the float ``model`` in place:
    QuaRot's Hadamard rotations (``qcore.adapters.passes.rotation.rotate_model``), or SpinQuant's learnt ones (``spinquant``
    above, which needs ``plans``,
    the quantizer's plan of the model, and calibration ``data``; ``gptq_follows`` decides SpinQuant's
    ``train_weights=None``)."""
    check_rotation(model, algo)
    if isinstance(algo, SpinQuantConfig):
        return spinquant(model, plans, data, algo, progress=progress,
                         train_weights=(not gptq_follows) if algo.train_weights is None else algo.train_weights)
    return rotate_model(model, key=algo.key, heads=algo.heads, online=algo.online, block=algo.block)

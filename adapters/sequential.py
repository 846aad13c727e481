"""Run quantization algorithms (GPTQ, AWQ, SmoothQuant, AutoSmoothQuant) on a torch model one decoder layer at a
time, in bounded memory.

``run_algorithms(model, plans, algorithms, batches)`` (called by ``quantize_model`` when the config lists
algorithms):

1. the decoder layers are found (``decoder_layers`` of the algorithm config, e.g. ``"model.layers"``, or the
   model's longest ``nn.ModuleList`` of identical blocks);
2. the calibration batches run through the model until the first layer; its inputs (hidden states and the
   keyword arguments: attention mask, position embeddings) are kept, once per batch;
3. for each layer in turn: each algorithm, in the order given, reads the statistics it needs from forwards of
   this layer alone over the kept inputs and rewrites the layer's float weights (scalings folded into the
   preceding op; GPTQ writes its quantized weights); then the layer's outputs over the kept inputs, with its
   weights as the algorithms left them, become the next layer's inputs.

Peak memory: the model plus two copies of one layer's inputs (``batches x tokens x hidden`` floats) and the
statistics of one layer (GPTQ: one ``in x in`` float64 Hessian per distinct input). Modules outside the decoder
layers (embeddings, the output head when not excluded) are quantized by round-to-nearest afterwards.

Returns ``{module name: QTensor}`` for the weights GPTQ quantized; ``quantize_model`` commits them as they are
(the exported checkpoint holds exactly these codes and scales).

Failure: every check (layer discovery, modules named in the configs, specs GPTQ cannot take, scaling groups
that cannot be folded) runs before any weight changes. An error or interrupt while layers are being processed
leaves the layers already done rewritten: the error says so, and the model is marked so that quantizing it again
is refused (reload it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

import qcore
from qcore.algorithms.config import (AutoSmoothQuantConfig, AWQConfig, GPTQConfig,
                                     parse_algorithms)
from qcore.algorithms.gptq import HessianStats, check_gptq_spec, gptq, update_hessian
from qcore.stats import RunningStats

from .config import MinMax, Percentile
from .modules import _norm_weight_granularity, _with_granularity

_log = logging.getLogger("qcore.adapters")

__all__ = ["run_algorithms", "find_decoder_layers", "AlgorithmError"]


class AlgorithmError(RuntimeError):
    """An algorithm failed after some decoder layers were already rewritten (the model must be reloaded)."""


class _Stop(Exception):
    pass


# ---------------------------------------------------------------------------------------------------------------
# layers and their inputs
# ---------------------------------------------------------------------------------------------------------------


def find_decoder_layers(model: nn.Module, path: Optional[str] = None) -> tuple[str, nn.ModuleList]:
    """``(dotted path, ModuleList)`` of the model's decoder layers: ``path`` if given, else the longest
    ``nn.ModuleList`` whose children are all of one type (ties: the one holding the most parameters)."""
    if path is not None:
        try:
            m = model.get_submodule(path)
        except AttributeError:
            lists = [n for n, x in model.named_modules() if isinstance(x, nn.ModuleList)]
            raise ValueError(f"decoder_layers {path!r} is not a module of the model; its ModuleLists: {lists[:5]}") from None
        if not isinstance(m, nn.ModuleList) or len(m) == 0:
            raise ValueError(f"decoder_layers {path!r} is a {type(m).__name__}, not a non-empty nn.ModuleList")
        return path, m
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0 and len({type(c) for c in m}) == 1:
            key = (len(m), sum(p.numel() for p in m.parameters()))
            if best is None or key > best[0]:
                best = (key, name, m)
    if best is None:
        raise ValueError("could not find the model's decoder layers (no nn.ModuleList of identical blocks); give "
                         "decoder_layers='model.layers' (Quark: model_decoder_layers) in the algorithm config")
    return best[1], best[2]


@dataclass
class _Inputs:
    """One layer's inputs, per batch: positional args and keyword args of the layer call."""

    args: list
    kwargs: list

    def __len__(self):
        return len(self.args)


def _replay_call(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A decoder layer's call ``(args, kwargs)`` as kept for replaying it: tensors detached, no KV cache."""
    kw = dict(kwargs)
    for k in ("past_key_value", "past_key_values", "layer_past"):
        if k in kw:
            kw[k] = None
    if "use_cache" in kw:
        kw["use_cache"] = False
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), kw


def _capture(model: nn.Module, layer0: nn.Module, batches: Sequence, device, progress: bool) -> _Inputs:
    from .quantizer import _call, _check_batch, _describe, _progress, _to

    args_l: list = []
    kwargs_l: list = []

    def pre(mod, args, kwargs):
        a, kw = _replay_call(args, kwargs)
        args_l.append(a)
        kwargs_l.append(kw)
        raise _Stop

    h = layer0.register_forward_pre_hook(pre, with_kwargs=True)
    cfg = getattr(model, "config", None)
    old_cache = getattr(cfg, "use_cache", None)
    try:
        if old_cache is not None:
            cfg.use_cache = False
        for i, batch in enumerate(_progress(batches, total=len(batches), desc="capturing layer inputs",
                                                  enabled=progress)):
            _check_batch(model, batch, i)
            try:
                _call(model, _to(batch, device))
            except _Stop:
                continue
            except (RuntimeError, ValueError, TypeError, IndexError) as e:
                raise ValueError(f"calibration batch {i} ({_describe(batch)}) does not fit the model: "
                                 f"{type(e).__name__}: {e}") from e
            raise ValueError(f"calibration batch {i}: the model's forward never reached its first decoder layer")
    finally:
        h.remove()
        if old_cache is not None:
            cfg.use_cache = old_cache
    return _Inputs(args_l, kwargs_l)


def _hidden(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _forward_layer(layer: nn.Module, inputs: _Inputs, *, keep: bool):
    """Run ``layer`` over every batch of ``inputs``; with ``keep`` return the next layer's ``_Inputs``."""
    nxt_args = []
    for args, kwargs in zip(inputs.args, inputs.kwargs):
        try:
            out = layer(*args, **kwargs)
        except _Stop:
            continue
        if keep:
            h = _hidden(out)
            if args:
                nxt_args.append((h,) + tuple(args[1:]))
            else:
                nxt_args.append(args)
                kwargs["hidden_states"] = h
    return _Inputs(nxt_args, inputs.kwargs) if keep else None


# ---------------------------------------------------------------------------------------------------------------
# GPTQ
# ---------------------------------------------------------------------------------------------------------------


def _weight_spec(module: nn.Module, plan, name: str):
    spec = plan.config.weight.spec
    w = module.weight
    g = _norm_weight_granularity(spec.granularity, "Linear", name, w.dim(), tuple(w.shape))
    return _with_granularity(spec, g)


def _scale_fn(plan, spec):
    """GPTQ's scale rule for a weight slice from the layer's weight observer (None: the spec's own rule)."""
    obs = plan.config.weight.observer
    if isinstance(obs, MinMax):
        return None
    if isinstance(obs, Percentile):
        def f(part):
            a = qcore.stats.percentile(part, spec.granularity, q=obs.q)
            return qcore.stats.scale_from_stats(RunningStats(spec.granularity, absmax=a, lo=-a, hi=a, count=1),
                                                spec)._asdict()
        return f

    def f(part):
        return qcore.stats.mse_clip(part, spec, grid=obs.grid, lo=obs.lo, p=obs.p)._asdict()
    return f


def _gptq_targets(layer: nn.Module, lplans: dict, algo: GPTQConfig, prefix: str) -> list[str]:
    names = list(algo.modules) if algo.modules else [n for n, p in lplans.items() if p.config.weight is not None]
    out = []
    for n in names:
        try:
            m = layer.get_submodule(n)
        except AttributeError:
            raise ValueError(f"gptq modules: {n!r} is not a module of decoder layer {prefix!r}; its Linears: "
                             f"{[k for k, v in layer.named_modules() if isinstance(v, nn.Linear)][:8]}") from None
        plan = lplans.get(n)
        if plan is None or plan.config.weight is None:
            if algo.modules:
                raise ValueError(f"gptq modules: {prefix}.{n} gets no weight quantization from the config")
            continue
        if type(m) is not nn.Linear:
            continue  # GPTQ here covers Linear layers; other module types are quantized by round-to-nearest
        spec = _weight_spec(m, plan, f"{prefix}.{n}")
        try:
            check_gptq_spec(spec, tuple(m.weight.shape))
        except ValueError as e:
            raise ValueError(f"gptq: {prefix}.{n}: {e}") from None
        out.append(n)
    return out


def _stages(layer: nn.Module, targets: list[str], inputs: _Inputs, true_sequential: bool) -> list[list[list[str]]]:
    """Targets grouped by shared input (the same tensor object) in call order; with ``true_sequential`` each
    input group is its own stage, else one stage holds every group."""
    order: list[str] = []
    seen: dict[str, torch.Tensor] = {}  # the input tensors themselves (kept alive, so identity is meaningful)

    def hook(name):
        def f(mod, args):
            if name not in seen:
                seen[name] = args[0]
                order.append(name)
        return f

    hs = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in targets]
    try:
        with torch.no_grad():
            _forward_layer(layer, _Inputs(inputs.args[:1], inputs.kwargs[:1]), keep=False)
    finally:
        for h in hs:
            h.remove()
    missing = [n for n in targets if n not in seen]
    if missing:
        raise ValueError(f"gptq: modules {missing} are not called by the decoder layer's forward")
    groups: list[list[str]] = []
    for n in order:
        g = next((g for g in groups if seen[g[0]] is seen[n]), None)
        if g is None:
            groups.append([n])
        else:
            g.append(n)
    return [[g] for g in groups] if true_sequential else [groups]


def _collect_hessians(layer, groups: list[list[str]], inputs: _Inputs, stop_after: Optional[str]):
    stats: dict[str, HessianStats] = {}
    heads = [g[0] for g in groups]

    def hook(name):
        def f(mod, args):
            x = args[0].detach()
            st = stats.get(name) or HessianStats.empty(x.shape[-1], like=x)
            stats[name] = update_hessian(st, x)
            if name == stop_after:
                raise _Stop
        return f

    hs = [layer.get_submodule(n).register_forward_pre_hook(hook(n)) for n in heads]
    try:
        _forward_layer(layer, inputs, keep=False)
    finally:
        for h in hs:
            h.remove()
    return stats


def _concat_ok(specs: list) -> bool:
    s0 = specs[0]
    if any(s != s0 for s in specs):
        return False
    g = s0.granularity
    return not s0.two_level and not isinstance(g, (qcore.PerTensor, qcore.PerBlock)) and not (
        isinstance(g, qcore.PerGroup) and g.axis % 2 == 0)


def _gptq_group(layer, names: list[str], hess: HessianStats, lplans: dict, algo: GPTQConfig, prefix: str,
                pinned: dict, reduce=None, reference: Optional[dict] = None) -> None:
    if reduce is not None:
        hess = reduce(hess)
    mods = [layer.get_submodule(n) for n in names]
    specs = [_weight_spec(m, lplans[n], f"{prefix}.{n}") for m, n in zip(mods, names)]
    fns = [_scale_fn(lplans[n], s) for n, s in zip(names, specs)]
    kw = dict(block_size=algo.block_size, damp=algo.damp, act_order=algo.act_order, static_groups=algo.static_groups)
    if len(mods) > 1 and _concat_ok(specs) and all(f is None for f in fns):
        # rows of weights sharing an input and a per-row/per-group spec are independent under one Hessian:
        # one GPTQ run over the stacked rows equals the runs one by one
        w = torch.cat([m.weight.detach().float() for m in mods], 0)
        r = gptq(w, hess, specs[0], **kw)
        rows = 0
        for n, m in zip(names, mods):
            k = m.weight.shape[0]
            q = r.qtensor
            part = qcore.quantize(r.weight[rows:rows + k], specs[0],
                                  scale=q.scales[rows:rows + k],
                                  zero_point=None if q.zero_points is None else q.zero_points[rows:rows + k])
            _write(m, part, pinned, f"{prefix}.{n}", reference)
            rows += k
        return
    for n, m, spec, fn in zip(names, mods, specs, fns):
        r = gptq(m.weight.detach().float(), hess, spec, scale_fn=fn, **kw)
        _write(m, r.qtensor, pinned, f"{prefix}.{n}", reference)


def _write(m: nn.Module, q, pinned: dict, name: str, reference: Optional[dict] = None) -> None:
    if reference is not None:  # the float weight GPTQ started from (after any folds), for the report
        reference[name] = m.weight.detach().to("cpu", copy=True)
    with torch.no_grad():
        m.weight.copy_(qcore.dequantize(q).to(m.weight.dtype))
    pinned[name] = q


def _run_gptq(layer, lplans, inputs: _Inputs, algo: GPTQConfig, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None) -> None:
    targets = _gptq_targets(layer, lplans, algo, prefix)
    if not targets:
        return
    stages = _stages(layer, targets, inputs, algo.true_sequential)
    for stage in stages:
        last_head = stage[-1][0]
        with torch.no_grad():
            stats = _collect_hessians(layer, stage, inputs, stop_after=last_head)
            for group in stage:
                _gptq_group(layer, group, stats[group[0]], lplans, algo, prefix, pinned, reduce, reference)
            del stats


# ---------------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------------


def _layers_path(algos) -> Optional[str]:
    paths = {a.decoder_layers for a in algos if a.decoder_layers is not None}
    if len(paths) > 1:
        raise ValueError(f"the algorithm configs name different decoder layers: {sorted(paths)}")
    return next(iter(paths), None)



def layer_plans(model: nn.Module, plans: list, algos) -> tuple[str, nn.ModuleList, list[dict]]:
    """``(path, layers, by_layer)``: the decoder layers the algorithms act on and, per layer, ``{name relative to
    the layer: LayerPlan}`` of its quantized modules (``qcore.adapters.streaming`` shares this)."""
    from .experts import check_experts_algorithms
    check_experts_algorithms(plans, algos)  # fused MoE experts: refused by name, before any work (issue 22)
    path, layers = find_decoder_layers(model, _layers_path(algos))
    by_layer: list[dict] = [{} for _ in layers]
    for p in plans:
        if p.name.startswith(path + "."):
            idx, _, rel = p.name[len(path) + 1:].partition(".")
            if idx.isdigit() and rel:
                by_layer[int(idx)][rel] = p
    if not any(by_layer):
        raise ValueError(f"the algorithms act on the decoder layers {path!r}, but the config quantizes none of "
                         f"their modules")
    return path, layers, by_layer


def check_layers(layers, by_layer: list[dict], algos, path: str) -> None:
    """Every check the algorithms make on the layers before any weight changes (shapes only: meta layers too)."""
    scalers = [a for a in algos if not isinstance(a, GPTQConfig)]
    if scalers:
        from .scaling_bind import check_scaling
        for i, layer in enumerate(layers):
            for a in scalers:
                check_scaling(layer, by_layer[i], a, f"{path}.{i}")
    for a in algos:
        if isinstance(a, GPTQConfig):
            for i, layer in enumerate(layers):
                _gptq_targets(layer, by_layer[i], a, f"{path}.{i}")


def run_layer(layer: nn.Module, lplans: dict, inputs: _Inputs, algos, prefix: str, pinned: dict, reduce=None,
              reference: Optional[dict] = None) -> None:
    """The algorithms, in order, on one decoder layer over its kept ``inputs`` (the per-layer step of
    ``run_algorithms``, shared with ``qcore.adapters.streaming``); GPTQ's QTensors go into ``pinned``, and (when
    ``reference`` is a dict) the float weights GPTQ started from into ``reference`` (CPU copies)."""
    for a in algos:
        if isinstance(a, GPTQConfig):
            _run_gptq(layer, lplans, inputs, a, prefix, pinned, reduce, reference)
        else:
            from .scaling_bind import apply_scaling
            apply_scaling(layer, lplans, inputs, a, prefix, reduce=reduce)


def check_algorithms(model: nn.Module, plans: list, algorithms) -> None:
    """The checks ``run_algorithms`` makes before changing anything (so a rotation that runs first can rely on
    the layer algorithms being able to run)."""
    algos = parse_algorithms(algorithms)
    if algos:
        path, layers, by_layer = layer_plans(model, plans, algos)
        check_layers(layers, by_layer, algos, path)


def run_algorithms(model: nn.Module, plans: list, algorithms, batches: Sequence, *, progress: bool = True,
                   reduce=None, reference: Optional[dict] = None) -> dict:
    """Apply ``algorithms`` (configs or dicts, in order) layer by layer; return ``{module name: QTensor}`` of
    the weights GPTQ quantized. ``plans``: ``plan_model``'s output; ``batches``: a sequence of calibration
    batches. ``reduce``: for several processes (each holding its share of the batches), a
    ``qcore.adapters.distributed.Distributed``: called on each layer's ``HessianStats`` (the sum over ranks, before
    GPTQ), its ``sum`` / ``max`` / ``min`` reduce other statistics; every rank then computes the same weights.
    ``reference``: a dict to receive ``{module name: float weight GPTQ started from}`` (CPU copies; the report's
    reference weights, ``qcore.adapters.layer_report``)."""
    from .quantizer import _device_of, _progress

    algos = parse_algorithms(algorithms)
    if not algos:
        return {}
    from qcore.algorithms.config import ROTATION_CONFIGS
    if any(isinstance(a, ROTATION_CONFIGS) for a in algos):
        raise ValueError("run_algorithms: rotations (quarot, spinquant) act on the whole model; run them through "
                         "quantize_model or qcore.adapters.rotation.apply_rotation")
    if not isinstance(batches, Sequence) or len(batches) == 0:
        raise ValueError("the algorithms need calibration data: pass a non-empty list of batches as data=")
    if reduce is not None:
        searching = [a.name for a in algos if isinstance(a, (AWQConfig, AutoSmoothQuantConfig))]
        if searching:
            raise ValueError(f"{searching} search over calibration samples, which distributed calibration does not "
                             f"share between ranks yet; run them in one process (gptq and smoothquant run "
                             f"distributed)")
    path, layers, by_layer = layer_plans(model, plans, algos)
    check_layers(layers, by_layer, algos, path)

    device = _device_of(model)
    was_training = model.training
    model.eval()
    pinned: dict = {}
    current: Optional[int] = None
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            inputs = _capture(model, layers[0], batches, device, progress)
            for i in _progress(range(len(layers)), total=len(layers), desc="algorithms, layer by layer",
                               enabled=progress):
                layer = layers[i]
                prefix = f"{path}.{i}"
                current = i
                run_layer(layer, by_layer[i], inputs, algos, prefix, pinned, reduce, reference)
                inputs = _forward_layer(layer, inputs, keep=True)
    except BaseException as e:
        if current is None:
            raise
        model._qcore_partial = True  # quantize_model refuses a half-rewritten model
        msg = (f"while running {[a.name for a in algos]} on decoder layer {current} of {path!r}; layers "
               f"0..{current} may already be rewritten: reload the model before quantizing it again")
        if not isinstance(e, Exception):  # KeyboardInterrupt, SystemExit: keep their type
            _log.warning("interrupted %s", msg)
            raise
        raise AlgorithmError(f"{type(e).__name__}: {e} ({msg})") from e
    finally:
        model.train(was_training)
    _log.info("algorithms %s on %d layers in %.1f s", [a.name for a in algos], len(layers), time.perf_counter() - t0)
    return pinned

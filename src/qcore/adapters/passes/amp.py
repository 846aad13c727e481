"""Layerwise mixed precision (AMP): measure each layer's sensitivity to each scheme, pick one scheme per layer.

    from qcore.adapters.passes.amp import amp_config
    config = amp_config(model, ["w_mxfp4_a_mxfp4", "w_fp8_a_fp8"], batches, target_bits=5.0)
    quantize_model(model, config, calibration_batches)   # then export_hf: Quark's layer_quant_config

``layer_sensitivity(model, schemes, batches)`` quantizes one *unit* at a time with one scheme, every other layer
left in float, and measures the loss change on ``batches`` (``Metric``):

- ``Metric.KL`` (default): the mean over output positions of ``KL(float model || model with the unit
  quantized)`` of the softmax over the last axis of the logits. Never negative and paired position by position,
  so a few batches rank the layers reliably; any model whose output is logits (``.logits``, a tensor, or the
  first item of a tuple).
- ``Metric.NLL``: the change of the mean next-token negative log-likelihood (causal LMs; batches of
  ``input_ids``): the loss the perplexity protocol measures; noisier (it can be negative).

A unit is one quantizable layer, or the layers that must share a scheme: by default those vLLM fuses into one
GEMM (``q_proj``/``k_proj``/``v_proj`` into ``qkv_proj``, ``gate_proj``/``up_proj`` into ``gate_up_proj``; its
Quark loader refuses shards with different schemes), measured together: ``tie=None`` takes them from the model's
architecture record (``Family.fused_units``; ``DEFAULT_TIE`` when its family has none). ``tie=()`` measures every
layer alone.

Schemes: a list of preset names (``qcore.adapters.presets``; the preset's global layer config, weights and
activations as the preset says: ``w_mxfp4_a_mxfp4`` is MXFP4 weights and dynamic MXFP4 activations,
``w_fp8_a_fp8`` fp8 weights and static fp8 activations), or a dict ``{name: LayerConfig or preset name}``. An
empty ``LayerConfig()`` (or None) is "leave in float": sensitivity 0, bits = the weight dtype's (16 for a
bfloat16 model). Bits per weight of a scheme come from ``QuantSpec.bits_per_element(weight shape)``: the
element bits plus scale bits amortised over the layer (MXFP4 4.25; fp8 per tensor 8 + 32/numel).

Cost: the float model runs once over ``batches``; the inputs of every decoder layer are kept (``layers x
tokens x hidden`` floats) and, for ``Metric.KL``, the float log-probabilities and probabilities (two ``tokens x
vocab`` float32 tensors: 200 MB per 512-token window of a 49k vocabulary). Each (unit, scheme) then runs only
from the unit's decoder layer to the output (the earlier layers are skipped, their outputs replayed), plus, for
schemes with static activation scales, one calibration pass through that decoder layer alone: about ``units x
schemes / 2`` forwards of the whole model, the output head included (the KL needs every logit). The KL is
computed 64 positions at a time, in cache (bit-identical to the whole-tensor expression). Without identifiable
decoder layers (no ``nn.ModuleList`` of identical blocks) every measurement is a full forward. The model is left
as it was (wrappers are removed, weights never written). Speed and profile: ``bench/results/SPEED_AMP.md``.

``amp_config(model, schemes, batches, target_bits=... | max_loss=...)`` measures (or takes ``sensitivity=``),
runs ``qcore.algorithms.mixed_precision.search`` and returns a ``ModelConfig`` whose ``by_name`` names every
layer of every unit with its chosen scheme (exact names; ``export_hf`` writes them as Quark's
``layer_quant_config``, which vLLM's Quark loader reads per layer), the global layer config being the scheme that
holds the most weights. The search adds the units' sensitivities (additive model): check the measured quality of
the result (``bench/results/AMP.md``).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn

from qcore.algorithms.mixed_precision import DEFAULT_RESOLUTION, MixedPrecision, search

from ..batches import FoundState, check_batch, describe_batch, device_of, progress_bar, set_module, to_device, logits_of
from ..config import LayerConfig, ModelConfig
from ..modules import QuantModule, calibrating, weight_granularity, with_granularity, wrap
from ..plan import plan_model

__all__ = ["Metric", "Sensitivity", "layer_sensitivity", "amp_config", "config_from_choice", "DEFAULT_TIE", "FLOAT"]

#: sibling layers vLLM fuses into one GEMM (its Quark loader needs one scheme for all shards), for a model whose
#: family has no architecture record; with a record, its ``fused_units`` (``qcore.adapters.families``)
from qcore._fsutil import model_sources

from ..families import DEFAULT_FUSED as DEFAULT_TIE  # noqa: E402
from ..families import family_or_none, fused_units  # noqa: E402
from ..presets import PRESETS, preset
from .checkpointing import amp_work, check_work_args
from .runner import LayerRunner
from .targets import check_experts_algorithms

#: the scheme name that leaves a layer in float when ``schemes`` is a list
FLOAT = "float"


class Metric(enum.Enum):
    """What ``layer_sensitivity`` measures (module docstring)."""

    KL = "kl"
    NLL = "nll"


@dataclass(frozen=True)
class Sensitivity:
    """Measured sensitivities: a value (``layer_sensitivity``'s result).

    units: tuples of layer names that take one scheme together.
    schemes: scheme names, in the order given.
    loss: ``loss[i][j]``: the loss change of unit ``i`` under scheme ``j`` (``metric``), all else in float.
    weights: number of weights of each unit.
    bits: ``bits[i][j]``: bits per weight of unit ``i`` under scheme ``j`` (averaged over its layers).
    metric: the ``Metric``.
    base: the float model's loss on the batches (mean NLL for ``Metric.NLL``; 0.0 for ``Metric.KL``).
    """

    units: tuple
    schemes: tuple
    loss: tuple
    weights: tuple
    bits: tuple
    metric: Metric
    base: float

    @staticmethod
    def label(unit: tuple) -> str:
        """The search's name of a unit: its layer names joined by ``+``."""
        return "+".join(unit)

    def tables(self) -> tuple[dict, dict, dict]:
        """``(sensitivity, weights, bits)`` as ``qcore.algorithms.mixed_precision.search`` takes them."""
        sens, w, b = {}, {}, {}
        for unit, losses, n, bits in zip(self.units, self.loss, self.weights, self.bits):
            k = self.label(unit)
            sens[k] = dict(zip(self.schemes, losses))
            w[k] = n
            b[k] = dict(zip(self.schemes, bits))
        return sens, w, b

    def search(self, *, target_bits: Optional[float] = None, max_loss: Optional[float] = None,
               resolution: int = DEFAULT_RESOLUTION) -> MixedPrecision:
        """``qcore.algorithms.mixed_precision.search`` over these sensitivities (its choice names units by
        ``label``)."""
        sens, w, b = self.tables()
        return search(sens, w, b, target_bits=target_bits, max_loss=max_loss, resolution=resolution)

    def to_dict(self) -> dict:
        """JSON-able (``from_dict`` inverts it)."""
        return {"units": [list(u) for u in self.units], "schemes": list(self.schemes),
                "loss": [list(x) for x in self.loss], "weights": list(self.weights),
                "bits": [list(x) for x in self.bits], "metric": self.metric.value, "base": self.base}

    @classmethod
    def from_dict(cls, d: Mapping) -> "Sensitivity":
        try:
            return cls(tuple(tuple(u) for u in d["units"]), tuple(d["schemes"]),
                       tuple(tuple(float(v) for v in x) for x in d["loss"]), tuple(int(n) for n in d["weights"]),
                       tuple(tuple(float(v) for v in x) for x in d["bits"]), Metric(d["metric"]), float(d["base"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"Sensitivity.from_dict: {e!r}; expected the keys of Sensitivity.to_dict()") from None


# ---------------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------------


def _schemes_arg(schemes: Any) -> dict[str, Optional[LayerConfig]]:

    def one(name, v):
        if v is None or (isinstance(v, LayerConfig) and v.empty):
            return None
        if isinstance(v, LayerConfig):
            return v
        if isinstance(v, str):
            if v == FLOAT:
                return None
            if v not in PRESETS:
                preset(v)  # raises the preset error with suggestions
            return preset(v).layer
        raise TypeError(f"schemes[{name!r}] must be a LayerConfig, a preset name or None, got {type(v).__name__}")

    if isinstance(schemes, Mapping):
        items = list(schemes.items())
    elif isinstance(schemes, Sequence) and not isinstance(schemes, str):
        for s in schemes:
            if not isinstance(s, str):
                raise TypeError(f"schemes as a list takes preset names (or {FLOAT!r}); got {s!r}; pass a dict "
                                f"{{name: LayerConfig}} for other configs")
        items = [(s, s) for s in schemes]
    else:
        raise TypeError(f"schemes must be a list of preset names or a dict {{name: LayerConfig}}, got "
                        f"{type(schemes).__name__}")
    if len(items) < 1:
        raise ValueError(f"schemes: got {schemes!r}; expected at least one scheme")
    out = {}
    for name, v in items:
        if not isinstance(name, str) or not name:
            raise ValueError(f"schemes: got the name {name!r}; expected non-empty str names")
        if name in out:
            raise ValueError(f"schemes: {name!r} is given twice")
        out[name] = one(name, v)
    return out


def _units(names: list[str], tie) -> list[tuple]:
    if isinstance(tie, (str, bytes)) or not all(
            isinstance(g, (tuple, list)) and g and all(isinstance(x, str) and x for x in g) for g in tie):
        raise ValueError(f"tie: got {tie!r}; expected a tuple of tuples of sibling module names, e.g. "
                         f"{DEFAULT_TIE!r}")
    present = set(names)
    done: set = set()
    units = []
    for n in names:
        if n in done:
            continue
        parent, _, leaf = n.rpartition(".")
        group = next((g for g in tie if leaf in g), None)
        if group is None:
            unit = (n,)
        else:
            unit = tuple(m for m in ((parent + "." if parent else "") + x for x in group) if m in present)
        done.update(unit)
        units.append(unit)
    return units


def _batches_arg(model, batches) -> list:
    if isinstance(batches, (torch.Tensor, Mapping)) or not isinstance(batches, Sequence) or not batches:
        raise TypeError(f"batches must be a non-empty list of batches (tensors, dicts or tuples), got "
                        f"{type(batches).__name__}")
    device = device_of(model)
    for i, b in enumerate(batches):
        check_batch(model, b, i)
    return [to_device(b, device) for b in batches]


def _logits(out) -> torch.Tensor:
    return logits_of(out, missing="the model's output ({type}) has no logits: layer_sensitivity needs a model "
                                  "returning logits (a tensor, .logits, or a tuple starting with them)")


def _input_ids(batch) -> torch.Tensor:
    ids = batch if isinstance(batch, torch.Tensor) else batch.get("input_ids") if isinstance(batch, Mapping) \
        else batch[0]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.dtype.is_floating_point:
        raise ValueError(f"Metric.NLL needs batches of input_ids [batch, sequence] (a causal LM); got "
                         f"{describe_batch(batch)}")
    return ids


# ---------------------------------------------------------------------------------------------------------------
# the KL of one batch
# ---------------------------------------------------------------------------------------------------------------

#: rows (output positions) per block of ``_kl_rows``: 64 x a 49k vocabulary is 12 MB, so a block's
#: log-softmax, difference and product stay in cache instead of writing four full ``tokens x vocab`` tensors
_KL_ROWS = 64


def _reference_kl_rows(ref: torch.Tensor, lg: torch.Tensor) -> torch.Tensor:
    """The landed per-position KL (kept as the reference the tests compare ``_kl_rows`` to):
    ``KL(p || q)`` with ``ref = log p`` and ``lg`` the logits of ``q``, over the last axis."""
    logq = torch.log_softmax(lg, dim=-1)
    return (ref.exp() * (ref - logq)).sum(-1)


def _kl_rows(ref: torch.Tensor, prob: torch.Tensor, lg: torch.Tensor) -> torch.Tensor:
    """``_reference_kl_rows(ref, lg)`` with ``prob = ref.exp()`` given, computed ``_KL_ROWS`` positions at a
    time: bit-identical to it (the log-softmax and the sum over the vocabulary are per row, the difference and
    product per element; a block never has a single row, whose sum torch would split across threads), with one
    pass over the logits instead of about ten over ``tokens x vocab`` tensors and no large temporaries. On CPU
    only: a GPU's reductions may be laid out by the number of rows, and its memory makes the temporaries cheap."""
    v = lg.shape[-1]
    rows = lg.numel() // v if v else 0
    if rows <= _KL_ROWS + 1 or lg.device.type != "cpu":
        return (prob * (ref - torch.log_softmax(lg, dim=-1))).sum(-1)
    lg2, ref2, prob2 = lg.reshape(rows, v), ref.reshape(rows, v), prob.reshape(rows, v)
    out = torch.empty(rows, dtype=lg.dtype, device=lg.device)
    starts = list(range(0, rows, _KL_ROWS))
    if rows - starts[-1] == 1:  # no single-row block (see above)
        starts.pop()
    for s, e in zip(starts, starts[1:] + [rows]):
        d = torch.log_softmax(lg2[s:e], dim=-1)
        torch.sub(ref2[s:e], d, out=d)  # ref - logq, in place
        d.mul_(prob2[s:e])
        torch.sum(d, dim=-1, out=out[s:e])
    return out.reshape(lg.shape[:-1])


# ---------------------------------------------------------------------------------------------------------------
# running from one decoder layer on
# ---------------------------------------------------------------------------------------------------------------


class _Probe:
    """The float model's reference (log-probabilities or NLL) and its per-layer inputs over the batches
    (``qcore.adapters.passes.runner.LayerRunner.record``); forwards from decoder layer ``k`` on (``run_from``)."""

    def __init__(self, model, batches, metric, progress):
        self.model, self.batches, self.metric = model, batches, metric
        self.runner = LayerRunner(model, required=False, progress=progress)
        self.ref: list = []
        nll = []

        self.prob: list = []  # exp(ref), computed once (the landed code recomputed it for every measurement)

        def each(i, out):
            lg = _logits(out).float()
            if metric is Metric.KL:
                ref = torch.log_softmax(lg, dim=-1)
                self.ref.append(ref)
                self.prob.append(ref.exp())
            else:
                nll.append(self._nll(lg, batches[i]))

        self.inputs = self.runner.record(batches, each=each, desc="float model")  # [layer] -> LayerInputs
        self.base = float(sum(s for s, _ in nll) / sum(n for _, n in nll)) if nll else 0.0

    @staticmethod
    def _nll(lg, batch):
        ids = _input_ids(batch)
        loss = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), ids[:, 1:].reshape(-1),
                                                 reduction="sum")
        return float(loss), ids[:, 1:].numel()

    def layer_of(self, name: str) -> Optional[int]:
        """The index of the decoder layer holding module ``name`` (None: outside the decoder layers)."""
        return self.runner.layer_of(name)

    def _run(self, k: Optional[int], *, stop: Optional[int] = None):
        """Each batch's logits (float32) from decoder layer ``k`` on (None: the whole model); through layer
        ``stop`` only if given (nothing yielded)."""
        inputs = None if k is None else self.inputs[k]
        for out in self.runner.run_from(k, self.batches, inputs=inputs, stop=stop):
            yield _logits(out).float()

    def calibrate(self, k: Optional[int], stop: Optional[int], wrappers: list) -> None:
        mods = [w for w in wrappers if isinstance(w, QuantModule) and w.static_roles()]
        if not mods:
            return
        with calibrating(mods):
            for _ in self._run(k, stop=stop):
                pass

    def measure(self, k: Optional[int]) -> float:
        total, count = 0.0, 0
        for i, lg in enumerate(self._run(k)):
            if self.metric is Metric.KL:
                kl = _kl_rows(self.ref[i], self.prob[i], lg)
                total += float(kl.double().sum())
                count += kl.numel()
            else:
                s, n = self._nll(lg, self.batches[i])
                total += s
                count += n
        return total / count - self.base


# ---------------------------------------------------------------------------------------------------------------
# public functions
# ---------------------------------------------------------------------------------------------------------------


def layer_sensitivity(model: nn.Module, schemes: Any, batches: Sequence, *, metric: Metric = Metric.KL,
                      exclude: Optional[tuple] = None, tie: Optional[tuple] = None,
                      progress: bool = True, work_dir=None, resume: bool = False) -> Sensitivity:
    """The loss change of ``model`` on ``batches`` when one unit of layers alone is quantized with one scheme,
    for every unit and scheme (module docstring: metrics, units, schemes, cost).

    exclude: module names/patterns never quantized (default: the model's output head, as ``ModelConfig``).
    The layers measured are those every non-float scheme quantizes under ``ModelConfig(scheme, exclude=exclude)``.
    work_dir, resume: each measurement is saved in ``work_dir`` as it is made; ``resume=True`` continues a run
    saved there, measuring only what is missing (``qcore.adapters.passes.checkpointing``).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(metric, Metric):
        raise TypeError(f"metric must be a qcore.adapters.passes.amp.Metric, got {metric!r}")
    if not isinstance(progress, bool):
        raise TypeError(f"progress must be a bool, got {progress!r}")

    work_path = check_work_args(work_dir, resume, sources=model_sources(model))
    fam = family_or_none(model)
    head = model.get_output_embeddings() if callable(getattr(model, "get_output_embeddings", None)) else None
    if fam is not None and not fam.causal and head is None:
        raise TypeError(f"layer_sensitivity: {type(model).__name__} (model_type {fam.model_type!r}, the {fam.name} "
                        f"record) is an encoder without a language-model head, so it has no logits to measure "
                        f"(give a model returning logits, e.g. BertForMaskedLM)")
    table = _schemes_arg(schemes)
    quantized = {n: lc for n, lc in table.items() if lc is not None}
    plans: dict[str, dict] = {}
    for n, lc in quantized.items():
        try:
            plans[n] = {p.name: p for p in plan_model(model, ModelConfig(lc, exclude=exclude))}
        except ValueError as e:
            raise ValueError(f"schemes[{n!r}]: {e}") from None
    if not plans:
        raise ValueError(f"schemes: got {list(table)}; expected at least one that quantizes (not only float)")
    check_experts_algorithms([p for pl in plans.values() for p in pl.values()], (), who="amp")  # issue 22
    mods = dict(model.named_modules())
    names = [n for n in mods if all(n in p for p in plans.values())]
    if not names:
        raise ValueError("the schemes quantize no common layer of the model")
    if tie is None:
        tie = fused_units(model)
    units = _units(names, tie)
    batches = _batches_arg(model, batches)

    def weight_bits(name: str, scheme: str) -> float:
        w = mods[name].weight
        lc = table[scheme]
        if lc is None or lc.weight is None:  # left in float
            return float(w.element_size() * 8)
        p = plans[scheme][name]
        g = weight_granularity(p.config.weight.spec.granularity, p.type, name, w.dim(), tuple(w.shape))
        return with_granularity(p.config.weight.spec, g).bits_per_element(tuple(w.shape))

    found = FoundState(model, hooks=False)
    model.eval()
    cfg = getattr(model, "config", None)
    old_cache = getattr(cfg, "use_cache", None)
    try:
        if old_cache is not None:
            cfg.use_cache = False
        jobs = [(u, s) for u in units for s in table if table[s] is not None]
        work = None if work_path is None else amp_work(work_path, resume, model, table, batches, metric, exclude,
                                                       units, jobs)
        runner = _Probe(model, batches, metric, progress)
        loss: dict = {} if work is None else work.done()
        for unit, s in progress_bar(jobs, total=len(jobs), desc="layer sensitivity", enabled=progress):
            if (unit, s) in loss:  # measured by the run saved in work_dir
                continue
            where = [runner.layer_of(n) for n in unit]
            k = None if None in where else min(where)  # outside the decoder layers: full forwards
            stop = None if k is None else max(where)
            originals = [(n, mods[n]) for n in unit]
            wrappers = [(n, wrap(mods[n], plans[s][n].config, name=n)) for n in unit]
            try:
                for n, w in wrappers:
                    set_module(model, n, w)
                runner.calibrate(k, stop, [w for _, w in wrappers])
                loss[(unit, s)] = runner.measure(k)
                if work is not None:
                    work.add(unit, s, loss[(unit, s)])
            finally:
                for n, m in originals:
                    set_module(model, n, m)
    finally:
        found.restore()
        if old_cache is not None:
            cfg.use_cache = old_cache

    out_loss, out_w, out_bits = [], [], []
    for unit in units:
        counts = [mods[n].weight.numel() for n in unit]
        out_w.append(sum(counts))
        out_loss.append(tuple(0.0 if table[s] is None else loss[(unit, s)] for s in table))
        out_bits.append(tuple(sum(c * weight_bits(n, s) for n, c in zip(unit, counts)) / sum(counts)
                              for s in table))
    return Sensitivity(tuple(units), tuple(table), tuple(out_loss), tuple(out_w), tuple(out_bits), metric,
                       runner.base)


def _pattern(name: str) -> str:
    return "re:" + re.escape(name) if any(c in name for c in "*?[]") or name.startswith("re:") else name


def amp_config(model: nn.Module, schemes: Any, batches: Optional[Sequence] = None, *,
               target_bits: Optional[float] = None, max_loss: Optional[float] = None,
               sensitivity: Optional[Sensitivity] = None, metric: Metric = Metric.KL, exclude: Optional[tuple] = None,
               tie: Optional[tuple] = None, resolution: int = DEFAULT_RESOLUTION,
               progress: bool = True, work_dir=None, resume: bool = False) -> ModelConfig:
    """A ``ModelConfig`` with one scheme per layer: the least summed sensitivity within ``target_bits`` average
    bits per weight (over the measured layers), or the fewest bits within a summed sensitivity of ``max_loss``
    (give one). ``sensitivity``: a ``layer_sensitivity`` result for these ``schemes`` (then ``batches`` is not
    needed; e.g. to try several targets from one measurement). The config's ``by_name`` names every measured
    layer (module docstring); its ``exclude`` is ``exclude``."""
    if (target_bits is None) == (max_loss is None):
        raise ValueError(f"give exactly one of target_bits and max_loss; got target_bits={target_bits!r}, "
                         f"max_loss={max_loss!r}")
    table = _schemes_arg(schemes)
    if sensitivity is None:
        if batches is None:
            raise ValueError("amp_config: pass batches (to measure the sensitivities) or sensitivity=")
        sensitivity = layer_sensitivity(model, schemes, batches, metric=metric, exclude=exclude, tie=tie,
                                         progress=progress, work_dir=work_dir, resume=resume)
    elif not isinstance(sensitivity, Sensitivity):
        raise TypeError(f"sensitivity must be a Sensitivity (layer_sensitivity's result), got "
                        f"{type(sensitivity).__name__}")
    elif tuple(table) != sensitivity.schemes:
        raise ValueError(f"sensitivity: measured for schemes {list(sensitivity.schemes)}; expected the schemes "
                         f"given here, {list(table)}")
    result = sensitivity.search(target_bits=target_bits, max_loss=max_loss, resolution=resolution)
    return config_from_choice(sensitivity, table, result, exclude=exclude)


def config_from_choice(sensitivity: Sensitivity, schemes: Any, result: MixedPrecision, *,
                       exclude: Optional[tuple] = None) -> ModelConfig:
    """The ``ModelConfig`` of a search result over ``sensitivity``'s units (what ``amp_config`` returns)."""
    table = _schemes_arg(schemes)
    chosen = result.as_dict()
    by_name: dict = {}
    for unit in sensitivity.units:
        label = Sensitivity.label(unit)
        if label not in chosen:
            raise ValueError(f"result: no choice for unit {label!r}; expected a search over this sensitivity")
        for n in unit:
            by_name[_pattern(n)] = table[chosen[label]]
    top = max(result.scheme_weights, key=lambda kv: kv[1])[0]
    return ModelConfig(table[top] or LayerConfig(), by_name=by_name, exclude=exclude)


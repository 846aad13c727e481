"""Per-layer quality of a quantized model, as committed: what ``qcore quantize`` reports, ranks and plots.

Two numbers per quantized module, both measured on the weights the model holds after ``quantize_model`` (the
codes the export writes), not predicted from a round-to-nearest pass:

- ``weight_sqnr_db``: SQNR of the committed (dequantized) weight against its *reference* float weight, the
  float weight it was quantized from (``quantize_model(..., reference=)``). Without algorithms, or with GPTQ
  alone, that is the model's original float weight. After a rotation (QuaRot, SpinQuant) or a smoothing fold
  (AWQ, SmoothQuant) it is the transformed float weight: the layer computes, in float, what the original did
  (the transforms are exact), and the quantization error lives in that basis. GPTQ lowers the output error at
  the cost of a larger weight error, so its weight SQNR is usually *below* round-to-nearest's.
- ``output_sqnr_db``: SQNR of the module's output on calibration windows: the quantized module's output
  (quantized weight, quantized activations) against the reference float weight applied to the same input (the
  input the quantized model gives the module). Unlike the weight SQNR it weighs the error by the activations a
  layer sees, so it separates layers that the weight SQNR ties (per-channel fp8: every layer ~31.5 dB). Layers
  are ranked by it, worst (lowest) first. Measured for Linear, Conv2d, Embedding and transformers' Conv1D modules;
  None for others.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from qcore._fsutil import staged_file
from qcore.algorithms.metrics import sqnr_db, sqnr_db_of_sums

from ..batches import FoundState, call_model, device_of, progress_bar, to_device
from ..plan import quantized_modules
from ..modules import IN_OUT, weight_layout

__all__ = ["LayerError", "measure", "ranked", "block_and_kind", "figure", "save_plot"]


@dataclass(frozen=True)
class LayerError:
    """One quantized module's committed quality (see the module docstring)."""

    weight_sqnr_db: float
    output_sqnr_db: Optional[float]

    def to_dict(self) -> dict:
        return asdict(self)


def _reference_output(m: nn.Module, x: torch.Tensor, w: torch.Tensor) -> Optional[torch.Tensor]:
    """The module's float op with weight ``w`` on input ``x`` (None for module types not measured)."""
    bias = getattr(m, "bias", None)
    if isinstance(m, nn.Linear):
        return F.linear(x, w, bias)
    if isinstance(m, nn.Conv2d):
        return nn.Conv2d._conv_forward(m, x, w, bias)  # type: ignore[arg-type]
    if isinstance(m, nn.Embedding):
        return F.embedding(x, w, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq, m.sparse)
    if weight_layout(m) == IN_OUT:  # transformers' Conv1D (GPT-2): w is stored [in, out]
        return F.linear(x, w.t(), bias)
    return None


def measure(model: nn.Module, reference: dict, batches: Optional[list] = None, *, max_batches: int = 8,
            progress: bool = False) -> dict[str, LayerError]:
    """``{module name: LayerError}`` of every module of ``reference`` (``quantize_model(..., reference=)``'s
    dict) in ``model`` (quantized, committed; not yet frozen). ``batches``: calibration batches (the first
    ``max_batches`` are run through the model); None or empty: output SQNRs are None."""

    if not isinstance(reference, dict):
        raise TypeError(f"reference must be a dict of float weights, got {type(reference).__name__}")
    if isinstance(max_batches, bool) or not isinstance(max_batches, int) or max_batches < 1:
        raise ValueError(f"max_batches must be a positive int, got {max_batches!r}")
    mods = quantized_modules(model)
    missing = [n for n in reference if n not in mods]
    if missing:
        raise ValueError(f"reference names modules that are not quantized modules of the model: {missing[:5]}")
    weight = {}
    with torch.no_grad():
        for name, ref in reference.items():
            m = mods[name]
            if getattr(m, "frozen", False):
                raise ValueError(f"measure: {name!r} is frozen; measure before freeze()")
            weight[name] = sqnr_db(ref.float(), m.weight.detach().float())
    sums = {n: [0.0, 0.0] for n in reference}
    measured: set = set()
    if batches:
        device = device_of(model)
        handles = []

        def hook(name):
            def f(mod, args, out):
                if not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
                    return
                w = reference[name].to(device=out.device, dtype=mod.weight.dtype)
                y = _reference_output(mod, args[0], w)
                if y is None or y.shape != out.shape:
                    return
                y = y.float()
                d = out.detach().float() - y
                sums[name][0] += float(torch.sum(y * y, dtype=torch.float64))  # float64 accumulation
                sums[name][1] += float(torch.sum(d * d, dtype=torch.float64))
                measured.add(name)
            return f

        found = FoundState(model)  # taken before the hooks below (restore() would put them back otherwise)
        for name in reference:
            handles.append(mods[name].register_forward_hook(hook(name)))
        model.eval()
        try:
            with torch.no_grad():
                for b in progress_bar(batches[:max_batches], desc="measuring layer errors", enabled=progress):
                    call_model(model, to_device(b, device))
        finally:
            for h in handles:
                h.remove()
            found.restore()
    return {n: LayerError(weight[n], sqnr_db_of_sums(*sums[n]) if n in measured else None) for n in reference}


def ranked(errors: dict[str, LayerError]) -> list[str]:
    """Module names, worst first: by output SQNR (lowest first) where measured, then by weight SQNR."""
    def key(n):
        e = errors[n]
        o = e.output_sqnr_db
        return (o is None, o if o is not None else e.weight_sqnr_db, e.weight_sqnr_db, n)
    return sorted(errors, key=key)


_BLOCK = re.compile(r"\.(\d+)\.")


def block_and_kind(name: str) -> tuple[Optional[int], str]:
    """``(decoder block index, projection kind)`` of a module name: ``model.layers.3.self_attn.q_proj`` ->
    ``(3, 'q_proj')``; a module outside numbered blocks (``lm_head``) -> ``(None, name)``."""
    m = _BLOCK.search("." + name + ".")  # the first number: the decoder block (an expert index comes later)
    if m is None:
        return None, name
    return int(m.group(1)), name.rsplit(".", 1)[-1]


def figure(after: dict[str, LayerError], before: Optional[dict[str, LayerError]] = None, *, title: str):
    """A matplotlib Figure: two panels (weight SQNR, output SQNR; dB, higher is better) over decoder block
    (x), one line and marker per projection kind; ``before`` (round-to-nearest, when an algorithm ran) as thin
    dashed lines with open markers, ``after`` (committed) solid. Modules outside numbered blocks sit right of
    the last block. Needs matplotlib (the Agg backend; nothing is shown)."""
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    names = list(after)
    pos = {n: block_and_kind(n) for n in names}
    blocks = sorted({b for b, _ in pos.values() if b is not None})
    last = blocks[-1] if blocks else -1
    extra = sorted({n for n, (b, _) in pos.items() if b is None})
    xpos = {n: (b if b is not None else last + 1 + extra.index(n)) for n, (b, _) in pos.items()}
    kinds = list(dict.fromkeys(k for b, k in pos.values() if b is not None)) + extra
    has_out = any(e.output_sqnr_db is not None for e in after.values())
    panels = [("weight_sqnr_db", "weight SQNR (dB)")] + ([("output_sqnr_db", "output SQNR on calibration (dB)")]
                                                         if has_out else [])
    fig = Figure(figsize=(10.0, 1.0 + 2.6 * len(panels)), dpi=110)
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    markers = "osD^v<>pPX*h"
    for ax, (field, label) in zip(axes, panels):
        for i, kind in enumerate(kinds):
            members = sorted((n for n in names if (pos[n][1] == kind if pos[n][0] is not None else n == kind)),
                             key=lambda n: xpos[n])
            color = f"C{i % 10}"
            for series, style in ((before, dict(linestyle="--", linewidth=0.8, markerfacecolor="none", alpha=0.7)),
                                  (after, dict(linestyle="-", linewidth=1.3))):
                if series is None:
                    continue
                pts = [(xpos[n], getattr(series[n], field)) for n in members if n in series
                       and getattr(series[n], field) is not None and math.isfinite(getattr(series[n], field))]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[i % len(markers)], color=color,
                        markersize=4, label=kind if series is after else None, **style)
        ax.set_ylabel(label, fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=7)
    axes[-1].set_xlabel("decoder block" + (" (then: " + ", ".join(extra) + ")" if extra else ""), fontsize=8)
    ticks = blocks + [last + 1 + i for i in range(len(extra))]
    if ticks and len(ticks) <= 40:
        axes[-1].set_xticks(ticks, [str(b) for b in blocks] + extra)
    handles, labels = axes[0].get_legend_handles_labels()
    if before is not None:
        from matplotlib.lines import Line2D
        handles += [Line2D([], [], color="gray", linestyle="-", label="after the algorithm\n(committed)"),
                    Line2D([], [], color="gray", linestyle="--", markerfacecolor="none", marker="o",
                           label="round-to-nearest\n(before)")]
        labels += [h.get_label() for h in handles[-2:]]
    fig.legend(handles, labels, loc="center right", fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 0.78, 0.95))
    return fig


def save_plot(fig: Any, path: str) -> None:
    """Write ``fig`` as a PNG at ``path`` (staged beside it and renamed into place, ``qcore._fsutil.staged_file``:
    nothing half-written, nothing left behind)."""
    with staged_file(path, recheck=lambda: None) as tmp:
        fig.savefig(tmp, format="png")

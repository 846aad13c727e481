"""What the main job returns: ``QuantizeReport`` (its ``to_dict()`` is the JSON ``qcore quantize --report``
writes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from ..config import ModelConfig
from ..eval import layer_report
from ..io.compressed_tensors import CTExportInfo
from ..io.gguf import GGUFExportInfo

__all__ = ["QuantizeReport", "LAYER_ERROR_WINDOWS"]

LAYER_ERROR_WINDOWS = 4  # calibration windows the per-layer output errors are measured on




_LAYER_METRICS = {
    "weight": "SQNR (dB) of the committed weight against the float weight it was quantized from (the "
              "original; after a rotation or smoothing fold the transformed float weight)",
    "output": "SQNR (dB) of each module's output (quantized weight and activations) against its float "
              "weight on the same input, over the first calibration windows",
}


@dataclass(frozen=True)
class QuantizeReport:
    """What ``quantize_and_report`` (``qcore quantize``) did: ``to_dict()`` is the JSON ``--report`` writes.

    ``model`` describes the model (its path, or the module's class); ``config`` is the ``ModelConfig`` applied
    (with the algorithms that ran, and for ``amp`` the per-layer choice); ``kept_float`` the weights an exclusion
    left float (``FloatWeight``); ``ppl_baseline`` / ``ppl`` perplexity before and after (None with
    ``eval="none"``) on ``eval_windows`` windows of ``seq_len`` tokens; ``kl_divergence`` the mean over those
    windows' predictions of ``KL(P_float || P_quantized)`` (nats) and ``top1_agreement`` the fraction of predictions
    whose most likely token is the float model's (llama.cpp's ``--kl-divergence`` mean KLD and "same top p"),
    ``kl_per_window`` / ``top1_per_window`` the same per window (None with ``eval="none"`` or ``kl=False``);
    ``layer_errors`` each quantized module's
    ``LayerError`` (weight and output SQNR, ``qcore.adapters.eval.layer_report``), ``rtn_layer_errors`` the same by
    round-to-nearest when algorithms ran and a report or plot was asked for; sizes in bytes; the export's
    ``export_format``, ``output_dir``, ``bytes_on_disk``, ``quant_method``, ``export_seconds`` and the exporter's
    own ``export_info`` (``ExportInfo``, ``GGUFExportInfo``, ``ONNXExportInfo`` or ``CTExportInfo``);
    ``ppl_llama_cpp`` (``--export gguf`` with evaluation) the written file's perplexity on the same windows as
    llama.cpp's CPU backend computes it (``qcore.adapters.eval.llama_cpp``: 8-bit activation rounding per weight
    type, the F16 KV cache), None otherwise;
    ``onnx_dequantized`` the weights ``onnx_unsupported="dequantize"`` wrote as float. ``quantized_model`` and
    ``tokenizer`` are the frozen quantized model and its tokenizer (not part of the JSON, nor of equality).
    """

    model: str
    scheme: str
    config: ModelConfig
    layers_quantized: int
    kept_float: tuple
    ppl_baseline: Optional[float]
    ppl: Optional[float]
    eval_windows: int
    seq_len: int
    eval_text: Optional[str]
    calibration_samples: int
    quantize_seconds: float
    total_seconds: float
    peak_rss_bytes: int
    model_bytes_before: int
    model_bytes_frozen: int
    layer_errors: Mapping[str, Any]
    rtn_layer_errors: Optional[Mapping[str, Any]]
    static_scales: bool  # calibration set static activation / KV-cache scales
    kl_divergence: Optional[float] = None  # mean KL(float || quantized) per prediction, nats, on the ppl windows
    top1_agreement: Optional[float] = None  # fraction of predictions whose top-1 token is the float model's
    kl_per_window: Optional[tuple] = None
    top1_per_window: Optional[tuple] = None
    export_format: Optional[str] = None
    output_dir: Optional[str] = None
    bytes_on_disk: Optional[int] = None
    quant_method: Optional[str] = None
    export_seconds: Optional[float] = None
    export_info: Any = None
    ppl_llama_cpp: Optional[float] = None  # --export gguf: the written file's perplexity as llama.cpp computes it
    onnx_dequantized: tuple = ()
    moe_coverage: Any = None  # qcore.adapters.moe.ExpertCoverage of static calibration (MoE models), or None
    qcore_version: str = ""
    imatrix: Optional[str] = None  # the importance matrix the GGUF-spec modules used: its file, or "calib (N windows)"
    command: Optional[str] = None
    gguf_mix: Any = None  # qcore.adapters.gguf_mix.GGUFMix of a llama.cpp mix scheme (gguf_q4_k_m, ...), or None
    quantized_model: Any = field(default=None, compare=False, repr=False)
    tokenizer: Any = field(default=None, compare=False, repr=False)

    @property
    def algorithms(self) -> list:
        return [a.name for a in self.config.algorithms]

    @property
    def worst_layers(self) -> list:
        """Up to five module names, worst first (``layer_report.ranked``)."""
        return layer_report.ranked(dict(self.layer_errors))[:5]

    @property
    def ranked_by_output(self) -> bool:
        return any(e.output_sqnr_db is not None for e in self.layer_errors.values())

    def to_dict(self) -> dict:
        """The report as JSON-ready values (what ``qcore quantize --report FILE.json`` writes)."""
        gguf = self.export_info if isinstance(self.export_info, GGUFExportInfo) else None
        ct = self.export_info if isinstance(self.export_info, CTExportInfo) else None
        rtn = self.rtn_layer_errors
        return {
            "model": self.model, "scheme": self.scheme, "config": self.config.to_dict(),
            "algorithms": self.algorithms, "layers_quantized": self.layers_quantized,
            "kept_float": [{"weight": w.name, "shape": list(w.shape), "why": w.why} for w in self.kept_float],
            "ppl_baseline": self.ppl_baseline, "ppl": self.ppl,
            "kl_divergence": self.kl_divergence, "top1_agreement": self.top1_agreement,
            "kl_per_window": None if self.kl_per_window is None else list(self.kl_per_window),
            "top1_per_window": None if self.top1_per_window is None else list(self.top1_per_window),
            "eval_windows": self.eval_windows,
            "seq_len": self.seq_len, "eval_text": self.eval_text or "pydoc protocol (anchors.md)",
            "calibration_samples": self.calibration_samples, "quantize_seconds": self.quantize_seconds,
            "total_seconds": self.total_seconds, "peak_rss_bytes": self.peak_rss_bytes,
            "model_bytes_before": self.model_bytes_before, "model_bytes_frozen": self.model_bytes_frozen,
            "bytes_on_disk": self.bytes_on_disk, "output_dir": self.output_dir, "export_format": self.export_format,
            "quant_method": self.quant_method,
            "gguf_lossless": None if gguf is None else gguf.lossless,
            "ppl_llama_cpp": self.ppl_llama_cpp,
            "gguf_inexact": None if gguf is None else [
                {"tensor": r.name, "type": r.gguf_type, "how": r.how, "max_abs_diff": r.max_abs_diff}
                for r in gguf.inexact],
            "gguf_dropped": None if gguf is None else list(gguf.dropped),
            "ct_lossless": None if ct is None else ct.lossless,
            "ct_inexact": None if ct is None else [
                {"tensor": n, "dtype": ct.tensors[n].dtype, "max_abs_diff": ct.tensors[n].max_abs_diff}
                for n in ct.inexact],
            "per_layer_sqnr_db": {n: e.weight_sqnr_db for n, e in self.layer_errors.items()},
            "per_layer_output_sqnr_db": {n: e.output_sqnr_db for n, e in self.layer_errors.items()},
            "per_layer_rtn_sqnr_db": None if rtn is None else {n: e.weight_sqnr_db for n, e in rtn.items()},
            "per_layer_rtn_output_sqnr_db": None if rtn is None else {n: e.output_sqnr_db for n, e in rtn.items()},
            "worst_layers": self.worst_layers,
            "layer_metrics": {
                **_LAYER_METRICS,
                "output_windows": min(self.calibration_samples, LAYER_ERROR_WINDOWS),
                "rtn": "the same scheme by round-to-nearest without the algorithms (with --algo and --report/--plot)",
                "ranked_by": "output SQNR" if self.ranked_by_output else "weight SQNR (no calibration windows)"},
            "moe_coverage": None if self.moe_coverage is None else self.moe_coverage.to_dict(),
            "gguf_mix": None if self.gguf_mix is None else {
                "mix": self.gguf_mix.mix, "counts": self.gguf_mix.counts(), "types": dict(self.gguf_mix.types),
                "fallbacks": {n: {"wanted": c.wanted, "type": c.type}
                              for n, c in self.gguf_mix.fallbacks().items()}},
            "qcore_version": self.qcore_version,
            "imatrix": self.imatrix,
            "command": self.command,
        }

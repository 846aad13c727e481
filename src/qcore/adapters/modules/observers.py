"""Static activation observers (statistics only, never activations): ``Observer``, what ``calibrating`` runs a
module's static roles through, and ``quantize_observed``, a tensor quantized with the scales its observer gives."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Optional

import torch

import qcore
from qcore import PerTensor, QuantSpec
from qcore._backend import ops
from qcore.quantize import tensor_scale_from_amax
from qcore.stats import RunningStats

from ..config import ExponentSearch, FourOverSix, MinMax, Percentile, TensorConfig

__all__ = ["CalibrationError", "Observer", "calibrating", "quantize_observed"]


class CalibrationError(ValueError):
    """A calibration statistic is NaN or Inf, or a calibration batch does not fit the model."""


class Observer:
    """Running statistics of one static activation role, as values updated per batch."""

    def __init__(self, tc: TensorConfig, spec: QuantSpec, where: str):
        self.tc, self.spec, self.where = tc, spec, where
        # two-level activations calibrate their per-tensor scale only (block scales are per call)
        self.stats = RunningStats.empty(PerTensor() if spec.two_level else spec.granularity)
        self.sum: Optional[torch.Tensor] = None
        self.sum_zp: Optional[torch.Tensor] = None
        self.n = 0

    def _check(self, v, what: str):
        if not bool(torch.isfinite(v).all()):
            bad = "NaN" if bool(torch.isnan(v).any()) else "Inf"
            raise CalibrationError(f"calibration: {bad} met in the {what} of {self.where} (batch {self.n + 1}); "
                                   f"statistics need finite activations")

    def update(self, x: torch.Tensor) -> None:
        obs = self.tc.observer
        x = x.detach()
        if isinstance(obs, MinMax):
            self.stats = self.stats.update(x)
            self._check(self.stats.absmax, "statistics")
        elif isinstance(obs, Percentile):
            p = qcore.stats.percentile(x, self.spec.granularity, q=obs.q).double()
            self._check(p, "percentile")
            self.sum = p if self.sum is None else self.sum + p
        else:
            pr = qcore.stats.mse_clip(x, self.spec, grid=obs.grid, lo=obs.lo, p=obs.p)
            self._check(pr.scale, "MSE-chosen scale")
            s = pr.scale.double()
            s = torch.log2(s) if self.spec.pow2_scale else s
            self.sum = s if self.sum is None else self.sum + s
            if pr.zero_point is not None:
                z = pr.zero_point.double()
                self.sum_zp = z if self.sum_zp is None else self.sum_zp + z
        self.n += 1

    def params(self):
        """(scale, zero_point or None) as float32 tensors of the spec's scale shape."""
        if self.n == 0:
            raise CalibrationError(f"calibration: {self.where} saw no calibration batch (is it reached by the "
                                   f"model's forward?)")
        obs = self.tc.observer
        if self.spec.two_level:
            a = self.stats.absmax.reshape(())
            return tensor_scale_from_amax(a, self.spec, ops(a), a), None
        if isinstance(obs, MinMax):
            p = qcore.stats.scale_from_stats(self.stats, self.spec)
            return p.scale, p.zero_point
        mean = (self.sum / self.n)
        if isinstance(obs, Percentile):
            a = mean.float()
            rs = RunningStats(self.spec.granularity, absmax=a, lo=-a, hi=a, count=self.n)
            p = qcore.stats.scale_from_stats(rs, self.spec)
            return p.scale, p.zero_point
        if self.spec.pow2_scale:
            scale = torch.exp2(torch.round(mean)).float()
        else:
            scale = mean.float()
        zp = None if self.sum_zp is None else torch.round(self.sum_zp / self.n).float()
        return scale, zp


@contextlib.contextmanager
def calibrating(mods: Iterable[Any]):
    """Observe static activation statistics on ``mods`` inside the block, then set their scales; on any error
    the observers are dropped and the scales left as they were (``abort_calibration``)."""
    mods = list(mods)
    for m in mods:
        m.start_calibration()
    try:
        yield
        for m in mods:
            m.finish_calibration()
    except BaseException:
        for m in mods:
            m.abort_calibration()
        raise


def quantize_observed(x: torch.Tensor, spec: QuantSpec, obs: Any):
    """QTensor of ``x`` with the scales its observer gives: MinMax (the spec's own rule), Percentile (the
    percentile's absmax), MSE (the clipping search), FourOverSix (NVFP4's 4-or-6 block scales and their tensor
    scale) or ExponentSearch (MX exponents); what every wrapper quantizes a weight (or an expert's slice) with."""
    if isinstance(obs, MinMax):
        return qcore.quantize(x, spec)
    if isinstance(obs, FourOverSix):
        return qcore.quantize(x, spec, **qcore.stats.four_over_six(x, spec).kwargs())
    if isinstance(obs, ExponentSearch):
        return qcore.quantize(x, spec, **qcore.stats.exponent_search(x, spec, radius=obs.radius).kwargs())
    if isinstance(obs, Percentile):
        a = qcore.stats.percentile(x, spec.granularity, q=obs.q)
        p = qcore.stats.scale_from_stats(RunningStats(spec.granularity, absmax=a, lo=-a, hi=a, count=1), spec)
    else:
        p = qcore.stats.mse_clip(x, spec, grid=obs.grid, lo=obs.lo, p=obs.p)
    return qcore.quantize(x, spec, **p.kwargs())

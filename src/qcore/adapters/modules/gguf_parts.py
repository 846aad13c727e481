"""QTensors of GGUF (llama.cpp) weight specs: their stored scales (``GGUFScales``) as numpy, a QTensor from codes
and stored scales, and the rows of several such QTensors as one."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

import qcore
from qcore import QuantSpec
from qcore._kquants import GGUFScales, sub_scales

__all__ = ["gguf_numpy", "gguf_qtensor", "gguf_cat"]


def gguf_numpy(ss):
    """A ``GGUFScales`` with numpy fields (torch inputs give torch fields)."""

    def np_(v):
        return None if v is None else v.detach().cpu().numpy() if isinstance(v, torch.Tensor) else np.asarray(v)
    return GGUFScales(*(np_(getattr(ss, f.name)) for f in dataclasses.fields(ss)))


def gguf_qtensor(codes: np.ndarray, ss, spec: QuantSpec) -> "qcore.QTensor":
    """The QTensor of GGUF ``codes`` under stored scales ``ss`` (scales and offsets derived from them)."""
    scales, offsets = sub_scales(ss, spec.granularity.size)
    return qcore.QTensor(codes, scales, None, spec, None, None, offsets, ss)


def gguf_cat(qs: list) -> "qcore.QTensor":
    """GGUF-spec QTensors of consecutive rows (torch parts) as one."""
    if len(qs) == 1:
        return qs[0]

    def cat(vals):
        return None if vals[0] is None else torch.cat(vals)
    ss = [q.super_scales for q in qs]
    return qcore.QTensor(cat([q.codes for q in qs]), cat([q.scales for q in qs]), None, qs[0].spec, None, None,
                         cat([q.offsets for q in qs]),
                         GGUFScales(*(cat([getattr(x, f.name) for x in ss]) for f in dataclasses.fields(ss[0]))))

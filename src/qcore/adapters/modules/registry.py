"""The float module types qcore quantizes and their wrappers (``QUANT_CLASSES``), and ``wrap``."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..config import LayerConfig
from .conv import QuantConv2d, QuantConvTranspose2d
from .embedding import QuantEmbedding, QuantEmbeddingBag
from .experts import QuantExperts, is_fused_experts
from .layout import Conv1D
from .linear import QuantConv1D, QuantLinear

__all__ = ["QUANT_CLASSES", "wrap", "quantizable_type"]

QUANT_CLASSES = {nn.Linear: QuantLinear, nn.Conv2d: QuantConv2d, nn.ConvTranspose2d: QuantConvTranspose2d,
                 nn.Embedding: QuantEmbedding, nn.EmbeddingBag: QuantEmbeddingBag}
if Conv1D is not None:
    QUANT_CLASSES[Conv1D] = QuantConv1D


def wrap(module: nn.Module, config: LayerConfig, *, name: str = "", qat: bool = False,
         proj_weights: Any = ()) -> nn.Module:
    """The quantized wrapper of ``module`` (exact type match: Linear, Conv2d, ConvTranspose2d, Embedding,
    EmbeddingBag, transformers' Conv1D; or fused MoE experts of a known layout, ``QuantExperts``) for ``config``;
    ``module`` itself is not modified. ``proj_weights``: fused experts only, per-projection weight specs
    (``LayerPlan.proj_weights``; ``QuantExperts.from_module``)."""
    cls = QUANT_CLASSES.get(type(module))
    if cls is None and isinstance(module._parameters.get("gate_up_proj"), torch.Tensor):  # fused MoE experts
        return QuantExperts.from_module(module, config, name=name, qat=qat, proj_weights=proj_weights)
    if cls is None:
        raise TypeError(f"{name or 'module'}: cannot quantize a {type(module).__name__}; supported: "
                        f"{[c.__name__ for c in QUANT_CLASSES]}")
    if proj_weights:
        raise ValueError(f"{name or 'module'}: proj_weights applies to fused MoE experts only, not to a "
                         f"{type(module).__name__}")
    return cls.from_module(module, config, name=name, qat=qat)


def quantizable_type(m: nn.Module) -> Optional[str]:
    """The config's type name of module ``m`` (``"Linear"``, ``"Conv2d"``, ..., ``"Conv1D"``; ``"Experts"`` for fused
    MoE experts of a known layout and ``QuantExperts``), or None for a module qcore does not quantize (a subclass of
    a supported type included: only the exact classes of ``QUANT_CLASSES``)."""
    if isinstance(m, QuantExperts) or is_fused_experts(m):
        return "Experts"
    return next((c.__name__ for c in QUANT_CLASSES if type(m) is c), None)

"""Where a module's weight sits: ``weight_layout`` (a Linear-like weight stored ``[out, in]``, as ``nn.Linear``'s,
or ``[in, out]``, as transformers' ``Conv1D``: GPT-2's projections), float or quantized; ``linear_weight`` /
``linear_weight_spec``, the ``[out, in]`` matrix of a float Linear-like module and its weight spec on it."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from qcore import QuantSpec

from .granularity import weight_granularity, with_granularity

__all__ = ["OUT_IN", "IN_OUT", "weight_layout", "linear_weight", "linear_weight_spec", "Conv1D"]

try:
    from transformers.pytorch_utils import Conv1D
except ImportError:  # transformers absent: no model can hold a Conv1D
    Conv1D: Any = None

#: a Linear-like weight stored ``[out, in]`` (``nn.Linear``: ``y = x @ W^T``), the canonical layout of weight specs
OUT_IN = "out_in"
#: a Linear-like weight stored ``[in, out]`` (transformers' ``Conv1D``, GPT-2's projections: ``y = x @ W``)
IN_OUT = "in_out"


def weight_layout(module: nn.Module) -> Optional[str]:
    """How a Linear-like module stores its weight matrix: ``OUT_IN`` (``"out_in"``) for an ``nn.Linear``,
    ``IN_OUT`` (``"in_out"``) for transformers' ``Conv1D`` (GPT-2), float or quantized (``QuantLinear``,
    ``QuantConv1D``: their ``weight`` parameter keeps the float module's layout; a frozen module's packed codes
    and every weight spec are ``[out, in]``); None for any other module (convolutions, embeddings and fused
    experts map their axes through the wrapper's ``to_canonical``)."""
    if isinstance(module, nn.Linear):
        return OUT_IN
    if Conv1D is not None and isinstance(module, Conv1D):
        return IN_OUT
    return None


def linear_weight(m: nn.Module) -> Optional[torch.Tensor]:
    """The weight of a float Linear-like module as the Linear's ``[out, in]`` matrix: ``nn.Linear``'s parameter, or
    the transposed view of transformers' ``Conv1D`` parameter (in-place writes to it reach the parameter); None for
    any other module. What algorithms that treat a layer as ``x @ W^T`` (GPTQ, scale folding) read and write."""
    if type(m) is nn.Linear:
        return m.weight
    if Conv1D is not None and type(m) is Conv1D:
        return m.weight.t()
    return None


def linear_weight_spec(module: nn.Module, plan, name: str) -> QuantSpec:
    """The weight spec of ``plan`` (a ``LayerPlan``) on ``module``'s weight as a Linear's ``[out, in]`` matrix
    (``linear_weight``): the granularity normalised to that layout (what GPTQ, AWQ and SpinQuant quantize);
    ``name`` names the module in errors."""
    spec = plan.config.weight.spec
    w = linear_weight(module)  # [out, in]: nn.Linear's weight, transformers Conv1D's transposed
    g = weight_granularity(spec.granularity, "Linear", name, w.dim(), tuple(w.shape))
    return with_granularity(spec, g)

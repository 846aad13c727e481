"""Quantized drop-in wrappers for ``nn.Linear``, ``nn.Conv2d``, ``nn.ConvTranspose2d``, ``nn.Embedding``,
``nn.EmbeddingBag`` and transformers' ``Conv1D`` (GPT-2's projections, quantized as the Linear of ``W^T``).

Each wrapper subclasses the module it replaces (``isinstance(q, nn.Linear)`` holds, ``state_dict`` keeps the
original keys) and adds the quantization of its roles (``LayerConfig``: weight, input, output, bias):

- **weights** (and bias) are quantized once. By default (``qat=False``) the float weight is overwritten in place
  by its fake-quantized values (``qcore.dequantize(qcore.quantize(w))`` cast to the model dtype), so a
  fake-quantized model holds one copy of its weights; the scales are kept as buffers (``weight_scale``,
  ``weight_zero_point``, ``weight_tensor_scale``). If the weight changes afterwards (``load_state_dict``, an
  optimizer step, any in-place write), it is quantized again at the next forward (tracked by the tensor's
  version counter), never on every forward; a weight loaded together with its ``weight_scale`` (a saved
  fake-quantized model) is kept as saved when it lies exactly on those scales' grid. With ``qat=True`` the
  float weight stays the trainable master copy; the forward uses its fake-quantized value with straight-through
  gradients (recomputed while the weight requires grad and grad is enabled, otherwise cached until the weight
  changes).
- **activations** (input, output) are fake-quantized in the forward: dynamic scales per call, or static scales
  (buffers ``input_scale`` / ``input_zero_point``, ``output_scale`` / ``output_zero_point``) calibrated by
  ``qcore.adapters.calibrate``. Granularities are given on the ``[tokens, features]`` view (see
  ``qcore.adapters.config``).
- ``freeze()``: the weight becomes packed low-bit codes (``weight_packed``, ``qcore.packing``) plus scale codes;
  the forward dequantizes them and gives the fake-quantized weight bit for bit.

Quantization math is qcore's, in float32 (exact for float32, bfloat16 and float16 inputs); results are cast back
to the module's dtype once.

The package (``from qcore.adapters.modules import X`` for every public name below):

- ``base``: ``QuantModule``, the state and machinery every wrapper shares (specs, weights pending / in place / QAT
  / frozen, static and dynamic activations, calibration, GGUF block bytes) and the public accessors exporters,
  importers and algorithms read (``specs``, ``effective``, ``scales``, ...); ``StoredScales``,
  ``is_quantized_module``;
- ``linear`` (``QuantLinear``, ``QuantConv1D``), ``conv`` (``QuantConv2d``, ``QuantConvTranspose2d``),
  ``embedding`` (``QuantEmbedding``, ``QuantEmbeddingBag``), ``experts`` (``QuantExperts``: fused MoE experts;
  ``KNOWN_EXPERTS``, ``experts_layout_problem``, ``experts_weight_spec``, ``is_fused_experts``);
- ``registry``: ``QUANT_CLASSES`` and ``wrap``;
- ``layout``: ``weight_layout`` (``OUT_IN`` / ``IN_OUT``: a Linear-like weight stored ``[out, in]`` or, as
  transformers' ``Conv1D``, ``[in, out]``), ``linear_weight``, ``linear_weight_spec``;
- ``granularity``: the axis maps of a config's granularities to the module's tensors;
- ``observers``: ``Observer`` (static activation statistics), ``calibrating``, ``CalibrationError``;
- ``lowrank``: SVDQuant's low-rank branch buffers (``LowRankBranch``, ``add_low_rank_branch``,
  ``low_rank_modules``);
- ``gguf_parts``: QTensors of GGUF weight specs (stored scales, rows);
- ``rotation``: online rotations as module state (``InputRotation`` forward pre-hooks; ``input_rotations``,
  ``online_plan``, ``install_online``, ``online_hooks``, ``remove_online``).
"""

from __future__ import annotations

from .base import FROZEN, INPLACE, PENDING, QAT, QuantModule, StoredScales, dequantize_dispatch, \
    fake_quantize_dispatch, is_quantized_module
from .conv import QuantConv2d, QuantConvTranspose2d
from .embedding import QuantEmbedding, QuantEmbeddingBag
from .experts import (EXPERT_PROJS, KNOWN_EXPERTS, QuantExperts, experts_layout_problem, experts_weight_spec,
                      is_fused_experts)
from .gguf_parts import gguf_cat, gguf_numpy, gguf_qtensor
from .granularity import activation_granularity, weight_granularity, with_granularity
from .layout import IN_OUT, OUT_IN, linear_weight, linear_weight_spec, weight_layout
from .linear import QuantConv1D, QuantLinear
from .lowrank import LowRankBranch, add_low_rank_branch, low_rank_modules
from .observers import CalibrationError, Observer, calibrating, quantize_observed
from .registry import QUANT_CLASSES, quantizable_type, wrap
from .rotation import (InputRotation, ReferenceInputRotation, input_rotations, install_online, online_hooks,
                       online_plan, remove_online)

__all__ = ["QuantLinear", "QuantConv2d", "QuantConvTranspose2d", "QuantEmbedding", "QuantEmbeddingBag",
           "QUANT_CLASSES", "wrap", "is_quantized_module", "CalibrationError", "QuantExperts", "LowRankBranch",
           "add_low_rank_branch", "low_rank_modules", "StoredScales", "QuantModule", "weight_layout", "OUT_IN",
           "IN_OUT", "quantizable_type", "FROZEN", "INPLACE", "PENDING", "QAT", "dequantize_dispatch",
           "fake_quantize_dispatch", "EXPERT_PROJS", "KNOWN_EXPERTS", "experts_layout_problem",
           "experts_weight_spec", "is_fused_experts", "gguf_cat", "gguf_numpy", "gguf_qtensor",
           "activation_granularity", "weight_granularity", "with_granularity", "linear_weight", "linear_weight_spec",
           "Observer", "calibrating", "quantize_observed", "InputRotation", "ReferenceInputRotation",
           "input_rotations", "install_online", "online_hooks", "online_plan", "remove_online"]
if QuantConv1D is not None:
    __all__.append("QuantConv1D")

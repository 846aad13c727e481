"""qcore's torch adapters: quantize torch models from a declarative config.

    from qcore.adapters import quantize_model, preset
    model = quantize_model(model, preset("w_uint4_per_group_asym", group_size=64))

Importing this package imports torch. Nothing is registered anywhere on import.
"""

from .config import (MSE, KVCacheConfig, LayerConfig, MinMax, ModelConfig, Percentile, TensorConfig, spec_from_dict,
                     spec_to_dict)
from .modules import (CalibrationError, QuantConv2d, QuantConvTranspose2d, QuantEmbedding, QuantEmbeddingBag,
                      QuantLinear, wrap)
from .presets import PRESETS, preset, preset_names
from .quantizer import calibrate, freeze, model_bytes, plan_model, quantize_model, quantized_modules

__all__ = [
    "ModelConfig", "LayerConfig", "TensorConfig", "KVCacheConfig", "MinMax", "Percentile", "MSE",
    "spec_to_dict", "spec_from_dict", "PRESETS", "preset", "preset_names",
    "QuantLinear", "QuantConv2d", "QuantConvTranspose2d", "QuantEmbedding", "QuantEmbeddingBag", "wrap",
    "CalibrationError", "quantize_model", "plan_model", "calibrate", "freeze", "model_bytes", "quantized_modules",
]

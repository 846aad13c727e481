"""qcore's torch adapters: quantize torch models from a declarative config.

    from qcore.adapters import quantize_model, preset
    model = quantize_model(model, preset("w_uint4_per_group_asym", group_size=64))

The main job (what ``qcore quantize`` does: load, quantize, evaluate, export, report) is one function:

    from qcore.adapters import quantize_and_report
    report = quantize_and_report("path/to/model", "uint4_wo_64", algorithms=["gptq"], output="out")

Importing this package imports torch. When transformers is installed, it also registers the quantization method
``"qcore"`` with transformers (``transformers.quantizers.register_quantization_config`` / ``register_quantizer``),
so ``AutoModelForCausalLM.from_pretrained`` loads qcore checkpoints; nothing else is registered anywhere.
"""

from .config import (MSE, ExponentSearch, FourOverSix, KVCacheConfig, LayerConfig, MinMax, ModelConfig, Percentile,
                     TensorConfig, spec_from_dict, spec_to_dict)
from .modules import (CalibrationError, QuantConv2d, QuantConvTranspose2d, QuantEmbedding, QuantEmbeddingBag,
                      QuantLinear, wrap)
from .presets import PRESETS, preset, preset_names
from .plan import FloatWeight, excluded_weights, plan_model, quantized_modules, unquantized_weights
from .calibration import calibrate, freeze, model_bytes
from .quantizer import quantize_model
from .io.quark_hf import ExportInfo, export_hf
from .io import from_pretrained
from .io.quark_hf import CorruptCheckpointError, load_quark, register_with_transformers
from .io.gguf import GGUFImportReport, from_gguf
from .gguf_mix import GGUF_MIX_PRESETS, GGUFMix, gguf_mix
from .distributed import Distributed
from .jobs.checkpoint import quantize_checkpoint
from .jobs.quantize import QuantizeJob, QuantizeReport, quantize_and_report

register_with_transformers()  # the one registration qcore makes (documented above); a no-op without transformers

__all__ = [
    "ModelConfig", "LayerConfig", "TensorConfig", "KVCacheConfig", "MinMax", "Percentile", "MSE", "FourOverSix",
    "ExponentSearch",
    "spec_to_dict", "spec_from_dict", "PRESETS", "preset", "preset_names",
    "QuantLinear", "QuantConv2d", "QuantConvTranspose2d", "QuantEmbedding", "QuantEmbeddingBag", "wrap",
    "CalibrationError", "quantize_model", "plan_model", "calibrate", "freeze", "model_bytes", "quantized_modules",
    "unquantized_weights", "excluded_weights", "FloatWeight",
    "export_hf", "ExportInfo", "from_pretrained", "load_quark", "CorruptCheckpointError", "register_with_transformers",
    "from_gguf", "GGUFImportReport", "gguf_mix", "GGUFMix", "GGUF_MIX_PRESETS",
    "Distributed", "quantize_checkpoint",
    "quantize_and_report", "QuantizeJob", "QuantizeReport",
]

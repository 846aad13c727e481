"""qcore: exact low-precision numerics (the oracle) that also run fast on torch tensors.

The core needs numpy only; torch is imported only when torch tensors are passed in.
"""

from . import packing, stats
from .cast import cast, decode, encode
from .dtypes import (DTYPES, GGUF_DTYPES, BlockDType, FloatDType, GGUFDType, IntDType, ScaleMode, Specials, TensorScale,
                     get_dtype)
from .granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .quantize import QTensor, QuantSpec, dequantize, fake_quantize, fake_quantizer, make_spec, quantize
from .rounding import RoundingMode, round_to_integral, round_to_step
from .scales import floor_log2

__version__ = "0.1.0"

__all__ = [
    "DTYPES", "BlockDType", "FloatDType", "IntDType", "ScaleMode", "Specials", "TensorScale", "get_dtype",
    "GGUF_DTYPES", "GGUFDType",
    "RoundingMode", "round_to_integral", "round_to_step",
    "cast", "encode", "decode",
    "PerTensor", "PerChannel", "PerGroup", "PerBlock",
    "QuantSpec", "QTensor", "make_spec", "quantize", "dequantize", "fake_quantize", "fake_quantizer",
    "floor_log2", "packing", "stats",
]

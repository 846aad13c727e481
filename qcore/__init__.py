"""qcore: exact low-precision numerics (the oracle) that also run fast on torch tensors."""

from .dtypes import DTYPES, BlockDType, FloatDType, IntDType, ScaleMode, Specials, get_dtype
from .rounding import RoundingMode, round_to_integral, round_to_step
from .cast import cast, decode, encode

__version__ = "0.1.0"
from .granularity import PerBlock, PerChannel, PerGroup, PerTensor
from .quantize import QTensor, QuantSpec, dequantize, fake_quantize, make_spec, quantize
from .scales import floor_log2
from . import packing, stats

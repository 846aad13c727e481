"""GGUF (llama.cpp's file format): the block types qcore writes and reads, and the Llama schema. Pure numpy.

Block types (ggml's ``block_q4_0`` ... in ``ggml-common.h``; gguf-py 0.19 ``gguf.quants``). Each row of a tensor
(the input axis of a Linear weight) is cut into blocks of 32 consecutive elements; a tensor is stored as
``uint8 [rows, cols / 32 * block_bytes]``. 4-bit nibbles: byte ``j`` of a block holds element ``j`` in its low
nibble and element ``j + 16`` in its high nibble.

======== ==== ===================================== ========================================
type     id   block bytes                           value of element ``i``
======== ==== ===================================== ========================================
Q4_0     2    ``d`` fp16, ``qs[16]``                ``d * (q_i - 8)``, ``q_i`` in [0, 15]
Q4_1     3    ``d`` fp16, ``m`` fp16, ``qs[16]``    ``d * q_i + m``
Q8_0     8    ``d`` fp16, ``int8 q[32]``            ``d * q_i``
MXFP4    39   ``e`` uint8 (E8M0), ``qs[16]``        ``2**(e - 127) * e2m1(q_i)`` (OCP E2M1 codes)
======== ==== ===================================== ========================================

**When a qcore grid is exactly a GGUF type** (``gguf_type``; ``is_exact`` checks the values): the weight is a
2-D ``[out, in]`` matrix with ``in % 32 == 0``; its scales are constant over each block of 32 along the input
axis (per tensor, per output channel, or groups of a multiple of 32 along the input axis); no sub-block shifts,
unit exponent or two-level scale; and

- int4 symmetric (codes -8..7) -> Q4_0 with ``d = scale``;
- uint4 (symmetric or not) and int4 asymmetric -> Q4_1 with ``d = scale``, ``m = -scale * zero_point`` (codes
  and zero point shifted by 8 for int4);
- int8 symmetric (codes -128..127) -> Q8_0 with ``d = scale``;
- fp4 e2m1 with E8M0 scales in groups of 32 (MXFP4) -> MXFP4 with ``e`` the scale's E8M0 byte (never 255);

and, for the fp16 types, every ``d`` and ``m`` is exactly a float16: a qcore ``scale_dtype`` of float16 (or
float32 scales that happen to be float16) makes ``d`` exact, and Q4_0 / Q8_0 / symmetric uint4 are then exact.
Asymmetric Q4_1 is exact only where ``scale * zero_point`` also fits float16's 11 significant bits (float16
scales times a 4-bit zero point need up to 15): otherwise ``m`` is rounded to float16 and the value moves by at
most half a float16 ulp of ``m``. Then ggml's dequantization (``dequantize``, bit for bit gguf-py's) gives the
same float32 values as ``qcore.dequantize`` (``-0`` and ``+0`` compare equal: MXFP4's code 8 is ``+0``), which is
what ``is_exact`` verifies. Scales that are not float16 are rounded to float16 (nearest even) by ``encode``: the
codes are kept, the values move by at most half a float16 ulp of the scale times the code.

Import: ``decode`` reads blocks into a given qcore spec where it holds them (positive ``d``, Q4_1 offsets
``m = -d * k`` with an integer ``k``, E8M0 bytes other than 255). ``import_blocks`` finds the qcore spec of a
whole tensor whatever wrote it (``import_spec``; one spec per tensor, groups of 32): ggml's own Q4_0 quantizer
writes ``d = x[argmax |x|] / -8``, negative for a positive extreme, which is exact as uint4 with zero points
8 (``d > 0``) and 7 (``d < 0``, codes ``15 - q``); ``d = 0`` blocks get scale 1 and zero codes (exact in
value, not in bytes). Q4_1 written by ggml (``m = min``, generally not ``-d`` times an integer) has no qcore
grid: ``import_blocks`` says so and ``adapters.import_gguf`` imports such a tensor as its float
dequantization. On export, a 4-bit asymmetric grid whose zero points are all 7 or 8 is written as Q4_0
(``q4_0_holds``), so ggml's Q4_0 files go back byte for byte.

``encode`` / ``decode`` convert qcore parts (``quark_layout.WeightParts``: codes in the canonical layout and
scales of ``spec.scale_shape``) to and from block bytes; ``quantize_float`` is ggml's reference quantizer (for
weights no GGUF type holds exactly); ``dequantize`` is ggml's dequantizer.

The architectures (``ARCHS``, keyed by llama.cpp's ``general.architecture``: ``llama`` (also Mistral, and Mixtral
with experts), ``qwen2``, ``qwen3``, ``gemma``, ``gemma2``, ``gemma3``, ``phi3``, ``qwen2moe``, ``qwen3moe``,
``gpt2``, ``gptneox``): the tensors each graph reads (with experts: ``Arch.moe_layer``, ``EXPERT_TENSORS``), q/k
row order, biases, norm kind and offsets, expert metadata and routing (``Arch``); the hyperparameters
(``metadata`` / ``config_from_metadata``, one table ``HPARAMS`` both ways); ``qkv_heads_to_gguf`` /
``qkv_heads_from_gguf`` (GPT-NeoX's per-head fused qkv rows to llama.cpp's ``[q | k | v]`` and back);
``permute_qk`` / ``unpermute_qk`` (llama.cpp's row order of ``attn_q`` / ``attn_k`` for ``llama``: rotary pairs
interleaved instead of split in halves); ``hf_to_gguf_name`` (transformers' Llama names; other families name their
modules through their record, ``qcore.adapters.io.gguf.gguf_names``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

import qcore
from qcore import PerChannel, PerGroup, PerTensor, QuantSpec
from qcore.dtypes import IntDType

from .quark_layout import WeightParts
from .safetensors_io import CorruptCheckpointError

__all__ = ["BLOCK", "TYPES", "TYPE_BYTES", "gguf_type", "block_scales", "encode", "decode", "import_blocks",
           "import_spec", "q4_0_holds", "dequantize",
           "quantize_float", "is_exact", "hf_to_gguf_name", "gguf_to_hf_name", "permute_qk", "unpermute_qk",
           "qkv_heads_to_gguf", "qkv_heads_from_gguf",
           "llama_metadata", "metadata", "config_from_metadata", "Arch", "ARCHS", "HPARAMS", "LAYER_TENSORS",
           "TOP_TENSORS", "NORM_TENSORS", "EXPERT_TENSORS", "CorruptCheckpointError", "check_file", "TensorSpan", "GGML_SIZES",
           "GGML_NAMES", "WEIGHT_TYPES", "VALUE_TYPES", "read_header", "GGUFHeader", "MetaField", "check_model_file",
           "GGUFModel", "metadata_differences", "MetadataDifference"]

BLOCK = 32
# type name -> (ggml type id, bytes per block of 32)
TYPES = {"F32": (0, None), "F16": (1, None), "Q4_0": (2, 18), "Q4_1": (3, 20), "Q8_0": (8, 34), "BF16": (30, None),
         "MXFP4": (39, 17)}
TYPE_BYTES = {k: v[1] for k, v in TYPES.items() if v[1] is not None}
# ggml block types held exactly by qcore's GGUF specs (``QuantSpec.gguf``, ``qcore.GGUF_DTYPES``): ggml type name
# -> qcore's name. A module with such a spec is written as that type from its block bytes
# (``qcore.packing.pack_gguf_blocks``), and such a tensor imports as codes of that spec (byte for byte).
GGUF_SPEC_KINDS = {"Q2_K": "q2_k", "Q3_K": "q3_k", "Q4_K": "q4_k", "Q5_K": "q5_k", "Q6_K": "q6_k", "Q4_0": "q4_0",
                   "Q4_1": "q4_1", "Q5_0": "q5_0", "Q5_1": "q5_1", "Q8_0": "q8_0", "IQ4_NL": "iq4_nl"}
GGUF_KIND_OF = {v: k for k, v in GGUF_SPEC_KINDS.items()}
# every block type qcore reads and writes
BLOCK_KINDS = frozenset(TYPE_BYTES) | frozenset(GGUF_SPEC_KINDS)
_BY_ID = {v[0]: k for k, v in TYPES.items()}

# OCP E2M1 code -> value, times 2 (ggml's kvalues_mxfp4)
_E2M1_X2 = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], np.int8)


def type_name(type_id: int) -> str:
    if type_id not in _BY_ID:
        raise ValueError(f"GGUF tensor type {type_id} is not one qcore reads; expected one of "
                         f"{ {v[0]: k for k, v in TYPES.items()} }")
    return _BY_ID[type_id]


# ---------------------------------------------------------------------------------------------------------------
# which type holds a spec
# ---------------------------------------------------------------------------------------------------------------


def _blocks_constant(spec: QuantSpec, shape: tuple) -> bool:
    g = spec.granularity
    if isinstance(g, PerTensor):
        return True
    if isinstance(g, PerChannel):
        return g.axis in (0, -2)
    if isinstance(g, PerGroup):
        return g.axis in (1, -1) and g.size % BLOCK == 0
    return False


def gguf_type(spec: QuantSpec, shape: tuple) -> Optional[str]:
    """The GGUF block type a weight of canonical ``shape`` quantized by ``spec`` maps to code for code (``Q4_0``,
    ``Q4_1``, ``Q8_0``, ``MXFP4``), or None when no GGUF type has its grid. Scales must still be float16-exact
    for the fp16 types (``is_exact``)."""
    if len(shape) != 2 or shape[1] % BLOCK or not _blocks_constant(spec, shape):
        return None
    if spec.subblock_shift_bits or spec.unit_exponent or spec.two_level:
        return None
    el = spec.dtype
    if isinstance(el, IntDType):
        if el.bits == 4 and el.signed and spec.symmetric:
            return "Q4_0"
        if el.bits == 4:
            return "Q4_1"
        if el.bits == 8 and el.signed and spec.symmetric:
            return "Q8_0"
        return None
    if (el.name == "float4_e2m1fn" and spec.scale_dtype.name == "float8_e8m0fnu" and isinstance(spec.granularity,
                                                                                                 PerGroup)
            and spec.granularity.size == BLOCK):
        return "MXFP4"
    return None


def q4_0_holds(parts: WeightParts, spec: QuantSpec, shape: tuple) -> bool:
    """Whether an asymmetric 4-bit weight (a Q4_1 grid by ``gguf_type``) is also a Q4_0 grid: every zero point
    is 8 or 7 (int4: 0 or -1), as in ggml's own Q4_0 files imported by ``import_blocks`` (``d * (q - 8)`` with
    ``d < 0`` is ``|d| * ((15 - q) - 7)``). Q4_0 stores no offset, so it is exact wherever the scales are
    float16, where Q4_1's ``m = -7 * d`` may need more bits."""
    if gguf_type(spec, shape) != "Q4_1" or spec.symmetric or parts.zero_points is None:
        return False
    z = np.asarray(parts.zero_points, np.float32) + (8 if spec.dtype.signed else 0)
    return bool(np.all((z == 7) | (z == 8)))


def block_scales(a: np.ndarray, spec: QuantSpec, shape: tuple) -> np.ndarray:
    """qcore scales (or zero points) of ``spec.scale_shape(shape)`` as one value per block: ``[rows, cols/32]``."""
    rows, cols = shape
    nb = cols // BLOCK
    a = np.asarray(a, np.float32)
    g = spec.granularity
    if isinstance(g, PerGroup):
        return np.ascontiguousarray(np.repeat(a.reshape(rows, -1), g.size // BLOCK, axis=1)[:, :nb])
    if isinstance(g, PerChannel):
        return np.ascontiguousarray(np.broadcast_to(a.reshape(rows, 1), (rows, nb)))
    return np.full((rows, nb), a.reshape(-1)[0], np.float32)


# ---------------------------------------------------------------------------------------------------------------
# block codecs
# ---------------------------------------------------------------------------------------------------------------


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values 0..15 -> [n, 16]: byte j = q[j] | q[j + 16] << 4."""
    return (q[:, :16] | (q[:, 16:] << np.uint8(4))).astype(np.uint8)


def _unpack_nibbles(qs: np.ndarray) -> np.ndarray:
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=1)


def _f16_bytes(d: np.ndarray) -> np.ndarray:
    return np.asarray(d, np.float32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def encode(parts: WeightParts, spec: QuantSpec, *, kind: str) -> np.ndarray:
    """qcore parts of a 2-D weight -> ``uint8 [rows, cols/32 * bytes]`` blocks of ``kind`` (see ``gguf_type``).
    float32 scales that are not float16 are rounded to float16 (nearest even); ``is_exact`` says whether the
    result equals the qcore weight."""
    codes = np.asarray(parts.codes)
    rows, cols = shape = codes.shape
    if kind not in TYPE_BYTES:
        raise ValueError(f"kind must be one of {sorted(TYPE_BYTES)}, got {kind!r}")
    q40 = kind == "Q4_0" and q4_0_holds(parts, spec, shape)
    if gguf_type(spec, shape) != kind and not q40:
        raise ValueError(f"a weight of shape {list(shape)} quantized as {spec.name or spec.dtype.name} "
                         f"({spec.granularity}) is not a {kind} grid (gguf_type gives {gguf_type(spec, shape)})")
    n = rows * cols // BLOCK
    c = codes.reshape(n, BLOCK).astype(np.int32)
    s = block_scales(parts.scales, spec, shape).reshape(n)
    # Blocks whose values are all 0 (Q4_1: all one value v) are written as ggml's quantizer writes them, d = 0
    # (Q4_0: -0.0, ggml's x[argmax |x|] / -8 of +0; Q4_1: m = v where v is a float16), so that such blocks of an
    # imported file (``import_blocks`` gives them scale 1) go back byte for byte; the values are the same.
    if q40 and not spec.symmetric:  # zero point 8: d = s, q = c; zero point 7: d = -s, q = 15 - c
        off = 8 if spec.dtype.signed else 0
        z = block_scales(parts.zero_points, spec, shape).reshape(n) + off
        c = c + off
        zero = np.all(c == z[:, None], axis=1)
        flip = z == 7
        c = np.where(flip[:, None], 15 - c, c)
        c = np.where(zero[:, None], 8, c)
        s = np.where(zero, np.float32(-0.0), np.where(flip, -s, s)).astype(np.float32)
        return np.concatenate([_f16_bytes(s), _pack_nibbles(c.astype(np.uint8))], axis=1).reshape(rows, -1)
    if kind == "Q4_0":
        s = np.where(np.all(c == 0, axis=1), np.float32(-0.0), s).astype(np.float32)
        return np.concatenate([_f16_bytes(s), _pack_nibbles((c + 8).astype(np.uint8))], axis=1).reshape(rows, -1)
    if kind == "Q4_1":
        off = 8 if spec.dtype.signed else 0
        z = (np.zeros(n, np.float32) if parts.zero_points is None
             else block_scales(parts.zero_points, spec, shape).reshape(n))
        m = -(s.astype(np.float64) * (z.astype(np.float64) + off))  # exact: both have few bits
        c = c + off
        k = c - (z.astype(np.int32) + off)[:, None]  # code minus zero point
        v = s.astype(np.float64) * k[:, 0]
        const = np.all(k == k[:, :1], axis=1) & (v.astype(np.float16).astype(np.float64) == v)
        s = np.where(const, np.float32(0), s).astype(np.float32)
        m = np.where(const, v, m)
        c = np.where(const[:, None], 0, c)
        return np.concatenate([_f16_bytes(s), _f16_bytes(m.astype(np.float32)), _pack_nibbles(c.astype(
            np.uint8))], axis=1).reshape(rows, -1)
    if kind == "Q8_0":
        s = np.where(np.all(c == 0, axis=1), np.float32(0), s).astype(np.float32)
        return np.concatenate([_f16_bytes(s), c.astype(np.int8).view(np.uint8)], axis=1).reshape(rows, -1)
    # MXFP4: the E8M0 byte of a power-of-two float32 scale
    bits = s.view(np.uint32)
    e = (bits >> np.uint32(23)) & np.uint32(0xFF)
    mant = bits & np.uint32(0x7FFFFF)
    ok = ((e != 0) & (e != 255) & (mant == 0)) | (bits == np.uint32(0x00400000))  # 2**-127: subnormal, byte 0
    if not bool(np.all(ok)):
        bad = s[~ok][0]
        raise ValueError(f"MXFP4 scales must be powers of two in [2**-127, 2**127] (E8M0), got {bad!r}")
    return np.concatenate([e.astype(np.uint8).reshape(-1, 1), _pack_nibbles(c.astype(np.uint8))],
                          axis=1).reshape(rows, -1)


def _blocks(data: np.ndarray, kind: str, shape: tuple, where: str) -> np.ndarray:
    rows, cols = shape
    if cols % BLOCK:
        raise CorruptCheckpointError(f"{where}: {cols} columns is not a multiple of the {kind} block of {BLOCK}")
    nbytes = rows * cols // BLOCK * TYPE_BYTES[kind]
    data = np.asarray(data)
    if data.dtype != np.uint8 or data.size != nbytes:
        raise CorruptCheckpointError(f"{where}: {kind} data of {data.size} {data.dtype} values, expected "
                                     f"{nbytes} uint8 for shape {list(shape)}")
    return data.reshape(-1, TYPE_BYTES[kind])


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32).reshape(-1)


def gguf_spec_blocks(data: np.ndarray, kind: str, shape: tuple, *, where: str = "tensor") -> np.ndarray:
    """``kind`` block bytes (a ``GGUF_SPEC_KINDS`` type) of a ``[rows, cols]`` tensor as uint8 ``[rows, bytes per
    row]``; CorruptCheckpointError naming ``where`` when the sizes do not match."""
    t = qcore.GGUF_DTYPES[GGUF_SPEC_KINDS[kind]]
    rows, cols = shape
    if cols % t.block_size:
        raise CorruptCheckpointError(f"{where}: {cols} columns is not a multiple of the {kind} block of "
                                     f"{t.block_size}")
    data = np.asarray(data)
    per_row = cols // t.block_size * t.type_size
    if data.dtype != np.uint8 or data.size != rows * per_row:
        raise CorruptCheckpointError(f"{where}: {kind} data of {data.size} {data.dtype} values, expected "
                                     f"{rows * per_row} uint8 for shape {list(shape)}")
    return np.ascontiguousarray(data).reshape(rows, per_row)


def dequantize(data: np.ndarray, kind: str, shape: tuple, *, where: str = "tensor") -> np.ndarray:
    """ggml's dequantization of ``kind`` blocks to float32 ``shape`` (bit for bit ``gguf.quants.dequantize``)."""
    if kind not in TYPE_BYTES and kind in GGUF_SPEC_KINDS:  # qcore's GGUF specs: ggml's values bit for bit
        b = gguf_spec_blocks(data, kind, shape, where=where)
        try:
            q = qcore.packing.unpack_gguf_blocks(b, GGUF_SPEC_KINDS[kind])
            return np.asarray(qcore.dequantize(q), np.float32).reshape(shape)
        except ValueError as e:
            raise CorruptCheckpointError(f"{where}: {e}") from None
    b = _blocks(data, kind, shape, where)
    n = b.shape[0]
    if kind == "Q4_0":
        d = _f16(b[:, :2]).reshape(n, 1)
        q = _unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)
        out = d * q.astype(np.float32)
    elif kind == "Q4_1":
        d, m = _f16(b[:, :2]).reshape(n, 1), _f16(b[:, 2:4]).reshape(n, 1)
        out = d * _unpack_nibbles(b[:, 4:]).astype(np.float32) + m
    elif kind == "Q8_0":
        out = _f16(b[:, :2]).reshape(n, 1) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)
    elif kind == "MXFP4":
        e = b[:, :1].astype(np.uint32)
        half = np.where(e < 2, np.uint32(0x00200000) << e, (e - np.uint32(1)) << np.uint32(23)).view(np.float32)
        out = half * _E2M1_X2[_unpack_nibbles(b[:, 1:])].astype(np.float32)
    else:
        raise ValueError(f"kind must be one of {sorted(TYPE_BYTES)}, got {kind!r}")
    return out.reshape(shape)


def decode(data: np.ndarray, kind: str, spec: QuantSpec, shape: tuple, *, where: str = "tensor") -> WeightParts:
    """``kind`` blocks -> qcore parts for ``spec`` (a ``PerGroup(32)`` spec whose ``gguf_type`` is ``kind``):
    codes in the canonical layout, float32 scales (and zero points) of ``spec.scale_shape(shape)``.
    A block with ``d = 0`` (ggml's all-zero block, as ``encode`` writes one) gets scale 1 and codes of value 0.
    CorruptCheckpointError (naming ``where``) for scales that are not finite and positive, an E8M0 byte 255, or
    a Q4_1 offset that is not ``-d * k`` for an integer code ``k`` (qcore's zero points are integer codes)."""
    rows, cols = shape
    g = spec.granularity
    if gguf_type(spec, shape) != kind or not (isinstance(g, PerGroup) and g.size == BLOCK):
        raise ValueError(f"decode {where}: spec {spec.name or spec.dtype.name} ({g}) is not the group-32 spec of "
                         f"{kind}")
    b = _blocks(data, kind, shape, where)
    nb = cols // BLOCK
    zp = None
    if kind == "MXFP4":
        e = b[:, 0].astype(np.uint32)
        if bool((e == 255).any()):
            raise CorruptCheckpointError(f"{where}: an MXFP4 block holds the E8M0 NaN byte 255")
        scales = np.where(e == 0, np.uint32(0x00400000), e << np.uint32(23)).view(np.float32)
        codes = _unpack_nibbles(b[:, 1:])
    else:
        scales = _f16(b[:, :2])
        zero = scales == 0  # ggml's all-zero blocks (``encode`` writes them so): scale 1, codes of value 0
        if kind == "Q8_0":
            codes = np.where(zero[:, None], 0, np.ascontiguousarray(b[:, 2:]).view(np.int8)).astype(np.int8)
        elif kind == "Q4_0":
            codes = np.where(zero[:, None], 0, _unpack_nibbles(b[:, 2:]).astype(np.int8) - np.int8(8)).astype(
                np.int8)
        else:
            m = _f16(b[:, 2:4])
            off = 8 if spec.dtype.signed else 0
            if bool(np.any(zero & (m != 0))):
                raise CorruptCheckpointError(f"{where}: Q4_1 blocks with d = 0 and m != 0 (import_blocks holds "
                                             f"them; decode gives the zero blocks only)")
            b = b.copy()
            b[zero, 4:] = 0
            with np.errstate(divide="ignore", invalid="ignore"):
                k = np.where(zero, 0.0, -m.astype(np.float64) / np.where(zero, 1.0, scales.astype(np.float64)))
            if not bool(np.all(np.isfinite(k) & (k == np.round(k)) & (k >= 0) & (k <= 15))):
                raise CorruptCheckpointError(f"{where}: Q4_1 offsets m that are not -d * k for an integer code k in "
                                             f"[0, 15]; qcore's integer zero points cannot hold them exactly")
            zp = (k - off).astype(np.float32).reshape(rows, nb)
            codes = (_unpack_nibbles(b[:, 4:]).astype(np.int16) - off).astype(np.int8 if off else np.uint8)
        scales = np.where(zero, np.float32(1), scales).astype(np.float32)
    if not bool(np.all(np.isfinite(scales) & (scales > 0))):
        raise CorruptCheckpointError(f"{where}: {kind} block scales that are not finite and positive")
    return WeightParts(codes=np.ascontiguousarray(codes.reshape(shape)), scales=scales.reshape(rows, nb).copy(),
                       zero_points=zp)


def import_spec(kind: str, *, signed: bool = True, symmetric: bool = True) -> QuantSpec:
    """The group-32 qcore spec ``import_blocks`` gives ``kind`` blocks: Q4_0 -> int4 symmetric (``signed``) or
    uint4 asymmetric; Q4_1 -> uint4 (``symmetric`` or not); Q8_0 -> int8 symmetric; MXFP4 -> mxfp4. Groups of 32
    along the input axis (``PerGroup(32, axis=1)``); float16 scales (E8M0 for MXFP4)."""
    g = PerGroup(BLOCK, 1)
    if kind == "Q4_0":
        return (qcore.make_spec("int4", granularity=g, scale_dtype="float16") if signed else
                qcore.make_spec("uint4", granularity=g, scale_dtype="float16", symmetric=False))
    if kind == "Q4_1":
        return qcore.make_spec("uint4", granularity=g, scale_dtype="float16", symmetric=symmetric)
    if kind == "Q8_0":
        return qcore.make_spec("int8", granularity=g, scale_dtype="float16")
    if kind == "MXFP4":
        return qcore.make_spec("mxfp4", axis=1)
    raise ValueError(f"kind must be one of {sorted(TYPE_BYTES)}, got {kind!r}")


def import_blocks(data: np.ndarray, kind: str, shape: tuple, *, where: str = "tensor"
                  ) -> tuple[Optional[QuantSpec], Optional[WeightParts], str]:
    """The qcore grid of a whole tensor of ``kind`` blocks, whatever wrote them: ``(spec, parts, "")`` when one
    qcore spec (``import_spec``, one per tensor) holds every block so that ``qcore.dequantize`` gives exactly
    ggml's values (``dequantize``; ``-0 == +0``), else ``(None, None, reason)``. Codes and scales are read from
    the blocks (no float round trip):

    - Q8_0 ``d * q``: int8 symmetric, scale ``d``, code ``q``; a block with ``d < 0`` is stored as ``|d|`` and
      ``-q`` (not possible for ``q = -128``: then no grid).
    - Q4_0 ``d * (q - 8)``: with ``d >= 0`` in every block, int4 symmetric, scale ``d``, code ``q - 8``. ggml's
      quantizer writes ``d = x[argmax |x|] / -8``, negative where the block's extreme is positive; a tensor
      with such blocks is uint4 asymmetric: ``d > 0`` -> code ``q``, zero point 8, scale ``d``; ``d < 0`` ->
      code ``15 - q``, zero point 7, scale ``|d|`` (``d * (q - 8) = |d| * ((15 - q) - 7)``).
    - Q4_1 ``d * q + m``: uint4 with scale ``|d|`` and integer zero point ``k = -m / d`` (code ``q``; for
      ``d < 0`` code ``15 - q`` and zero point ``15 - k``) where every block's ``k`` is an integer in
      [0, 15] (what qcore's exporter writes); symmetric when every ``k`` is 0. ggml's quantizer writes
      ``m = min(x)``, generally not such a multiple: then no grid (qcore's zero points are integer codes).
    - MXFP4: the E8M0 byte is the scale, the nibbles the E2M1 codes (exact always).
    - A block with ``d = 0`` (all values 0, or ``m`` for Q4_1) gets scale 1 and codes of value 0 (Q4_1 with
      ``m != 0``: scale ``|m|`` and code minus zero point ``sign(m)``): exact in value; ``encode`` writes such
      blocks back as ggml does (``d = 0``), so byte for byte too.

    CorruptCheckpointError (naming ``where``) for NaN / Inf ``d`` or ``m`` and the E8M0 NaN byte 255."""
    rows, cols = shape
    b = _blocks(data, kind, shape, where)
    n = b.shape[0]
    nb = cols // BLOCK

    def done(spec, codes, scales, zp=None):
        return spec, WeightParts(codes=np.ascontiguousarray(codes.reshape(shape)),
                                 scales=np.ascontiguousarray(scales, np.float32).reshape(rows, nb),
                                 zero_points=None if zp is None else
                                 np.ascontiguousarray(zp, np.float32).reshape(rows, nb)), ""

    if kind == "MXFP4":
        spec = import_spec(kind)
        parts = decode(data, kind, spec, shape, where=where)
        return spec, parts, ""
    d = _f16(b[:, :2])
    if not bool(np.all(np.isfinite(d))):
        raise CorruptCheckpointError(f"{where}: {kind} block scales d that are NaN or Inf")
    neg, zero = d < 0, d == 0
    scale = np.where(zero, np.float32(1), np.abs(d)).astype(np.float32)
    if kind == "Q8_0":
        q = np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.int16)
        if bool(np.any(neg[:, None] & (q == -128))):
            return None, None, "Q8_0 blocks with a negative scale d and code -128 (int8 cannot negate it)"
        c = np.where(zero[:, None], 0, np.where(neg[:, None], -q, q)).astype(np.int8)
        return done(import_spec(kind), c, scale)
    if kind == "Q4_0":
        q = _unpack_nibbles(b[:, 2:]).astype(np.int16)
        if not bool(neg.any()):
            return done(import_spec(kind), np.where(zero[:, None], 0, q - 8).astype(np.int8), scale)
        c = np.where(zero[:, None], 8, np.where(neg[:, None], 15 - q, q)).astype(np.uint8)
        zp = np.where(neg, np.float32(7), np.float32(8))
        return done(import_spec(kind, signed=False), c, scale, zp)
    if kind != "Q4_1":
        raise ValueError(f"kind must be one of {sorted(TYPE_BYTES)}, got {kind!r}")
    m = _f16(b[:, 2:4])
    if not bool(np.all(np.isfinite(m))):
        raise CorruptCheckpointError(f"{where}: Q4_1 block offsets m that are NaN or Inf")
    q = _unpack_nibbles(b[:, 4:]).astype(np.int16)
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(zero, 0.0, -m.astype(np.float64) / np.where(zero, 1.0, d.astype(np.float64)))
    with np.errstate(invalid="ignore"):
        ok = zero | ((k == np.round(k)) & (k >= 0) & (k <= 15) & (-(d.astype(np.float64) * k) == m))
    if not bool(ok.all()):
        i = int(np.argmin(ok))
        return None, None, (f"Q4_1 offsets m that are not -d * k for an integer zero point k in [0, 15] "
                            f"({int((~ok).sum())} of {n} blocks, e.g. d={float(d[i])!r}, m={float(m[i])!r}; "
                            f"ggml's quantizer writes m = min)")
    k = k.astype(np.int16)
    zp = np.where(neg, 15 - k, k)
    c = np.where(neg[:, None], 15 - q, q)
    # d = 0: every value is m; scale |m| with code - zero point = sign(m) (or scale 1, code = zero point for m = 0)
    mz = zero & (m != 0)
    scale = np.where(mz, np.abs(m), scale).astype(np.float32)
    zp = np.where(zero, np.where(m < 0, 1, 0), zp)
    c = np.where(zero[:, None], np.where(m > 0, 1, 0)[:, None], c)
    sym = not bool(zp.any())
    return done(import_spec(kind, symmetric=sym), c.astype(np.uint8), scale, None if sym else zp)


def is_exact(data: np.ndarray, kind: str, reference: np.ndarray) -> tuple[bool, float]:
    """(whether ggml's dequantization of ``data`` equals ``reference`` (float32, -0 == +0), max abs difference)."""
    ref = np.asarray(reference, np.float32)
    got = dequantize(data, kind, ref.shape)
    diff = float(np.max(np.abs(got.astype(np.float64) - ref.astype(np.float64)), initial=0.0))
    return bool(np.array_equal(got, ref)), diff


def _roundf(x: np.ndarray) -> np.ndarray:
    """C roundf (ties away from zero), as ggml."""
    return np.sign(x) * np.floor(np.abs(x) + np.float32(0.5))


def quantize_float(x: np.ndarray, kind: str) -> np.ndarray:
    """ggml's reference quantizer (``quantize_row_*_ref``, as gguf-py 0.19 ``gguf.quants.quantize``) of a float32
    ``[rows, cols]`` matrix to ``kind`` blocks ``uint8 [rows, cols/32 * bytes]``."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    if cols % BLOCK:
        raise ValueError(f"quantize_float: {cols} columns is not a multiple of {BLOCK}")
    b = x.reshape(-1, BLOCK)
    n = b.shape[0]
    with np.errstate(divide="ignore", invalid="ignore"):
        if kind == "Q4_0":
            imax = np.abs(b).argmax(axis=-1)[:, None]
            d = np.take_along_axis(b, imax, axis=-1) / np.float32(-8)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = np.trunc(b * inv + np.float32(8.5)).astype(np.uint8).clip(0, 15)
            out = np.concatenate([_f16_bytes(d), _pack_nibbles(q)], axis=1)
        elif kind == "Q4_1":
            hi, lo = b.max(axis=-1, keepdims=True), b.min(axis=-1, keepdims=True)
            d = (hi - lo) / np.float32(15)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = np.trunc((b - lo) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
            out = np.concatenate([_f16_bytes(d), _f16_bytes(lo), _pack_nibbles(q)], axis=1)
        elif kind == "Q8_0":
            d = np.abs(b).max(axis=1, keepdims=True) / np.float32(127)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
            q = _roundf(b * inv).astype(np.int8).view(np.uint8)
            out = np.concatenate([_f16_bytes(d), q], axis=1)
        elif kind == "MXFP4":
            amax = np.abs(b).max(axis=-1, keepdims=True)
            e = np.where(amax > 0, np.floor(np.log2(amax)) - 2 + 127, 0).astype(np.uint8)
            eu = e.astype(np.uint32)
            half = np.where(eu < 2, np.uint32(0x00200000) << eu, (eu - np.uint32(1)) << np.uint32(23)).view(np.float32)
            err = np.abs(half.reshape(n, 1, 1) * _E2M1_X2.astype(np.float32).reshape(1, 1, 16) - b.reshape(n, BLOCK, 1))
            q = np.argmin(err, axis=-1).astype(np.uint8)
            out = np.concatenate([e, _pack_nibbles(q)], axis=1)
        else:
            raise ValueError(f"kind must be one of {sorted(TYPE_BYTES)}, got {kind!r}")
    return out.reshape(rows, -1)


# ---------------------------------------------------------------------------------------------------------------
# Architectures: llama.cpp's graphs qcore writes and reads (data keyed by ``general.architecture``)
# ---------------------------------------------------------------------------------------------------------------

#: llama.cpp's per-layer tensor names (gguf-py ``TENSOR_NAMES``, ``blk.N.<name>.weight``) a graph may read.
#: ``qcore.adapters.io.gguf.gguf_names`` assigns them to a model's modules from its family record.
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "attn_q_norm", "attn_k_norm",
                 "post_attention_norm", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down", "post_ffw_norm",
                 "ffn_gate_inp", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps",
                 "ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
#: the mixture-of-experts tensors that are 3-D ``[E, out, in]`` (one ``[out, in]`` block matrix per expert; gguf-py
#: lists them in ggml's order ``[in, out, E]``): the gate and up halves of transformers' fused ``gate_up_proj``
#: (``[E, 2I, H]``: gate = the first ``I`` rows of each expert) and ``down_proj`` (``[E, H, I]``)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
#: the model-level tensors: token embedding, final norm, output head, learned positions (``Arch.position_embd``)
TOP_TENSORS = ("token_embd", "output_norm", "output", "position_embd")
#: the norms among them (``Arch.norm_offset`` applies to these)
NORM_TENSORS = ("attn_norm", "ffn_norm", "attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm",
                "output_norm")


@dataclass(frozen=True)
class Arch:
    """One llama.cpp architecture as qcore writes it (what its converter, convert_hf_to_gguf.py, does):

    - ``layer``: the per-layer tensors its graph reads (``LAYER_TENSORS``);
    - ``permute_qk``: ``attn_q`` / ``attn_k`` rows in llama.cpp's rotary order (``permute_qk``; the converter
      permutes for ``llama`` only; Qwen2/Qwen3/Gemma/Phi-3 keep transformers' order);
    - ``biases``: the tensors that may carry a ``.bias`` (Qwen2's q/k/v); a bias anywhere else is refused (the
      norms of a ``layernorm`` graph always carry theirs);
    - ``norm_offset``: added to every stored norm weight (Gemma: transformers computes ``x * (1 + w)``, the
      converter stores ``1 + w``; the embedding's ``sqrt(hidden)`` scale is inside llama.cpp's Gemma graph);
    - ``output``: whether the graph reads an ``output`` head (Gemma: always ``token_embd``);
    - ``acts``: the ``hidden_act`` values its graph computes (``silu``: SwiGLU; Gemma: GeGLU with tanh GELU);
    - ``hparams``: metadata beyond ``HPARAMS`` the graph needs, ``(key after "{arch}.", config key, kind)``, each
      required in the config (Gemma2's logit soft-capping and sliding window);
    - ``head_dim_keys``: config keys that must equal ``head_dim`` (Gemma2's ``query_pre_attn_scalar``: llama.cpp
      scales q by ``1 / sqrt(head_dim)``);
    - ``swa_pattern``: llama.cpp's graph applies the sliding window to layer ``i`` when ``i % swa_pattern <
      swa_pattern - 1`` (Gemma2: every other layer, from the first; Gemma3: five of six); 0: no sliding window;
    - ``swa_rope_theta``: the rope base llama.cpp's graph uses on its sliding-window layers (Gemma3: 10000, plain
      rope), where transformers gives each layer type its own ``rope_parameters``; None: one rope for all layers.
    - ``moe_layer``: the per-layer tensors of a model with mixture-of-experts layers (router ``ffn_gate_inp``,
      ``EXPERT_TENSORS``, Qwen2-MoE's shared expert ``ffn_*_shexp``); None: the graph has no experts. Mixtral is
      written as ``llama`` with these (what llama.cpp's converter does); ``qwen2moe`` / ``qwen3moe`` have experts
      in every layer (their ``layer`` is the same).
    - ``moe_hparams``: metadata of such a model (as ``hparams``, required; the expert count and top-k, the expert
      sizes), read back to the config keys of the family llama.cpp's converter writes as this architecture.
    - ``moe_norm_topk``: whether the graph renormalizes the routed top-k weights to sum to 1 (llama's and
      qwen3moe's do, qwen2moe's does not); a config whose ``norm_topk_prob`` differs is refused (Mixtral has no
      such key: transformers always renormalizes).
    - ``norm``: the graph's norms: ``rms`` (RMSNorm, weight only; the family record's ``norm`` is ``rms``, or
      ``rms_unit_offset`` with ``norm_offset`` 1) or ``layernorm`` (LayerNorm: mean subtracted, weight and
      ``.bias``; the record's ``layernorm``; GPT-2, GPT-NeoX). What a family record must say to be written.
    - ``config_aliases``: ``(qcore's config key, the family's own key)``: the transformers config spells the
      hyperparameter its own way (GPT-2's ``n_embd`` for ``hidden_size``); ``metadata`` reads it under either
      name, ``config_from_metadata`` gives it back under the family's.
    - ``skip_hparams``: ``HPARAMS`` keys the graph does not read (llama.cpp's converter does not write them, e.g.
      no rope for GPT-2, no ``head_count_kv`` or RMS epsilon for the LayerNorm graphs): neither written nor read.
    - ``requires``: ``(config key, value)`` settings the graph assumes; a config setting another value is refused
      (GPT-2's ``scale_attn_by_inverse_layer_idx``, GPT-NeoX without attention biases).
    - ``partial_rotary``: the graph rotates the first ``rope.dimension_count`` features of each head only
      (GPT-NeoX's ``partial_rotary_factor`` / ``rotary_pct``); elsewhere a partial rotary factor is refused.
    - ``ffn_mult``: ``intermediate_size`` is this times ``hidden_size`` when the config gives none (GPT-2's
      ``n_inner=None``); 0: the config must give it.
    - ``position_embd``: the graph adds learned absolute positions (``position_embd``, ``[context_length,
      hidden]``: GPT-2's ``wpe``), the family record's ``pos_embed``.
    - ``output_required``: the graph always reads an ``output`` head (GPT-NeoX): a head tied to the embedding is
      written as its own tensor (the same values; imported back untied).
    - ``tokenizer_pre``: llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``) for a converted byte-level BPE
      tokenizer when ``export_gguf`` is given none: ``gpt-2`` for GPT-2 and GPT-NeoX (transformers' ByteLevel
      split is GPT-2's regex; llama.cpp's ``olmo`` and ``mpt`` pre-tokenizers use the same one), ``default``
      elsewhere.
    """

    name: str
    layer: tuple
    permute_qk: bool = False
    biases: tuple = ()
    norm_offset: float = 0.0
    output: bool = True
    acts: tuple = ("silu",)
    hparams: tuple = ()
    head_dim_keys: tuple = ()
    swa_pattern: int = 0
    swa_rope_theta: Optional[float] = None
    moe_layer: Optional[tuple] = None
    moe_hparams: tuple = ()
    moe_norm_topk: Optional[bool] = None
    norm: str = "rms"
    config_aliases: tuple = ()
    skip_hparams: tuple = ()
    requires: tuple = ()
    partial_rotary: bool = False
    ffn_mult: int = 0
    position_embd: bool = False
    output_required: bool = False
    tokenizer_pre: str = "default"

    @property
    def family_norm(self) -> str:
        """The family record's ``norm`` (``qcore.adapters.families.NORM_KINDS``) this graph computes."""
        if self.norm == "layernorm":
            return "layernorm"
        return "rms_unit_offset" if self.norm_offset == 1.0 else "rms"


_ATTN_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output")
_MOE_FFN = ("ffn_norm", "ffn_gate_inp") + EXPERT_TENSORS
_MOE_USED = ("expert_used_count", "num_experts_per_tok", "u32")
_MOE_FF = ("expert_feed_forward_length", "moe_intermediate_size", "u32")
# the expert count's config key as transformers 5 spells it in to_dict() (Qwen3-MoE: num_local_experts)
_QWEN2MOE_HP = (("expert_count", "num_experts", "u32"), _MOE_USED, _MOE_FF,
                ("expert_shared_feed_forward_length", "shared_expert_intermediate_size", "u32"))
_QWEN3MOE_HP = (("expert_count", "num_local_experts", "u32"), _MOE_USED, _MOE_FF)
_QWEN2MOE_LAYER = _ATTN_LAYER + _MOE_FFN + ("ffn_gate_inp_shexp", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp")
_QWEN3MOE_LAYER = _ATTN_LAYER + ("attn_q_norm", "attn_k_norm") + _MOE_FFN
_LLAMA_LAYER = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up",
                "ffn_down")
_FUSED_LAYER = ("attn_norm", "attn_qkv", "attn_output", "ffn_norm", "ffn_up", "ffn_down")
_FUSED_PROJ = ("attn_qkv", "attn_output", "ffn_up", "ffn_down")
_GELUS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast", "gelu")
_LN_EPS = ("attention.layer_norm_epsilon", "layer_norm_eps", "f32")
_LN_SKIP = ("attention.head_count_kv", "attention.key_length", "attention.value_length",
            "attention.layer_norm_rms_epsilon")
_ROPE_KEYS = ("rope.dimension_count", "rope.freq_base")
_GPT2_ALIASES = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
                 ("max_position_embeddings", "n_positions"), ("intermediate_size", "n_inner"),
                 ("layer_norm_eps", "layer_norm_epsilon"), ("hidden_act", "activation_function"))
ARCHS = {
    # Mixtral: llama with experts (expert_count / expert_used_count; feed_forward_length is the expert size)
    "llama": Arch("llama", _LLAMA_LAYER, permute_qk=True, moe_layer=_ATTN_LAYER + _MOE_FFN,
                  moe_hparams=(("expert_count", "num_local_experts", "u32"), _MOE_USED), moe_norm_topk=True),
    # experts in every layer; Qwen2-MoE adds a shared expert (ffn_*_shexp) scaled by sigmoid(ffn_gate_inp_shexp)
    "qwen2moe": Arch("qwen2moe", _QWEN2MOE_LAYER, biases=("attn_q", "attn_k", "attn_v"), moe_layer=_QWEN2MOE_LAYER,
                     moe_hparams=_QWEN2MOE_HP, moe_norm_topk=False),
    "qwen3moe": Arch("qwen3moe", _QWEN3MOE_LAYER, moe_layer=_QWEN3MOE_LAYER, moe_hparams=_QWEN3MOE_HP,
                     moe_norm_topk=True),
    "qwen2": Arch("qwen2", _LLAMA_LAYER, biases=("attn_q", "attn_k", "attn_v")),
    "qwen3": Arch("qwen3", _LLAMA_LAYER + ("attn_q_norm", "attn_k_norm")),
    "gemma": Arch("gemma", _LLAMA_LAYER, norm_offset=1.0, output=False, acts=("gelu_pytorch_tanh", "gelu")),
    # sandwich norms: post_attention_norm / post_ffw_norm on the block outputs; sliding-window layers alternate
    # with global ones, as in transformers' layer_types
    "gemma2": Arch("gemma2", _LLAMA_LAYER + ("post_attention_norm", "post_ffw_norm"), norm_offset=1.0, output=False,
                   acts=("gelu_pytorch_tanh", "gelu"),
                   hparams=(("attention.sliding_window", "sliding_window", "u32"),
                            ("attn_logit_softcapping", "attn_logit_softcapping", "f32"),
                            ("final_logit_softcapping", "final_logit_softcapping", "f32")),
                   head_dim_keys=("query_pre_attn_scalar",), swa_pattern=2),
    # Gemma2's layout plus per-head q/k norms; no soft-capping; local (sliding) layers with their own rope base
    "gemma3": Arch("gemma3", _LLAMA_LAYER + ("attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"),
                   norm_offset=1.0, acts=("gelu_pytorch_tanh",),
                   hparams=(("attention.sliding_window", "sliding_window", "u32"),),
                   head_dim_keys=("query_pre_attn_scalar",), swa_pattern=6, swa_rope_theta=10000.0),
    # fused attn_qkv [q | k | v] rows and ffn_up [gate | up] rows (llama.cpp splits them as views)
    "phi3": Arch("phi3", _FUSED_LAYER),
    # LayerNorm (weight and bias) everywhere, biases on every projection, fused attn_qkv [q | k | v] rows, a GELU
    # MLP (llama.cpp's ggml_gelu: the tanh form; transformers' exact "gelu" differs by < 1e-3 of a unit)
    "gpt2": Arch("gpt2", _FUSED_LAYER, biases=_FUSED_PROJ, norm="layernorm", acts=_GELUS,
                 config_aliases=_GPT2_ALIASES, skip_hparams=_LN_SKIP + _ROPE_KEYS, ffn_mult=4,
                 hparams=(_LN_EPS,), position_embd=True, tokenizer_pre="gpt-2",
                 requires=(("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                           ("add_cross_attention", False))),
    # rope on the first rope.dimension_count features of each head (NeoX halves); parallel or sequential residual
    "gptneox": Arch("gptneox", _FUSED_LAYER, biases=_FUSED_PROJ, norm="layernorm", acts=_GELUS,
                    skip_hparams=_LN_SKIP, partial_rotary=True, output_required=True, tokenizer_pre="gpt-2",
                    hparams=(_LN_EPS, ("use_parallel_residual", "use_parallel_residual", "bool")),
                    requires=(("attention_bias", True),)),
}

# the Llama layout by transformers names (LlamaForCausalLM), for the module-name helpers below
_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP_BACK = {v: k for k, v in _TOP.items()}


def hf_to_gguf_name(name: str) -> Optional[str]:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight`` (transformers' Llama names; other
    families: ``adapters.export_gguf.gguf_names``); None for a name llama.cpp's Llama graph has no tensor for
    (e.g. rotary ``inv_freq`` buffers)."""
    base, _, suffix = name.rpartition(".")
    if suffix not in ("weight", "bias"):
        return None
    if base in _TOP:
        return f"{_TOP[base]}.{suffix}"
    mt = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", base)
    if mt and mt.group(2) in _LAYER:
        return f"blk.{int(mt.group(1))}.{_LAYER[mt.group(2)]}.{suffix}"
    return None


def gguf_to_hf_name(name: str) -> Optional[str]:
    base, _, suffix = name.rpartition(".")
    if base in _TOP_BACK:
        return f"{_TOP_BACK[base]}.{suffix}"
    mt = re.fullmatch(r"blk\.(\d+)\.(.+)", base)
    if mt and mt.group(2) in _LAYER_BACK:
        return f"model.layers.{int(mt.group(1))}.{_LAYER_BACK[mt.group(2)]}.{suffix}"
    return None


def _regroup_rows(rows: np.ndarray, n_head: int, k: int, dims: str, axes: tuple, who: str, what: str) -> np.ndarray:
    """The rows (first axis) of ``n_head`` heads of ``k`` parts of ``m`` rows each, viewed as ``dims`` (a
    permutation of ``"hkm"``: heads, parts, rows per part) with the two ``axes`` swapped: one rule for the four
    row orders below (any array whose first axis is the rows)."""
    r = rows.shape[0]
    if r % (k * n_head):
        raise ValueError(f"{who}: {r} rows do not split into {n_head} heads of {what}")
    size = {"h": n_head, "k": k, "m": r // n_head // k}
    return np.ascontiguousarray(rows.reshape(*(size[c] for c in dims), *rows.shape[1:]).swapaxes(*axes)
                                .reshape(rows.shape))


def permute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order of ``attn_q`` (``n_head`` heads) / ``attn_k`` (``n_head_kv``): within each head,
    the rows of the two rotary halves are interleaved (convert_hf_to_gguf's ``permute``). Works on any array whose
    first axis is the output rows (floats, block bytes, per-row scales)."""
    return _regroup_rows(rows, n_head, 2, "hkm", (1, 2), "permute_qk", "two rotary halves")


def unpermute_qk(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of ``permute_qk``."""
    return _regroup_rows(rows, n_head, 2, "hmk", (1, 2), "unpermute_qk", "two rotary halves")


def qkv_heads_to_gguf(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's row order of a fused ``attn_qkv`` from one interleaved per head (the family record's
    ``qkv_layout`` ``per_head``: GPT-NeoX's ``query_key_value``, rows ``[n_head, 3 (q, k, v), head_dim]``): all q
    rows, then all k, then all v (``[3, n_head, head_dim]``, convert_hf_to_gguf's GPTNeoXModel). Works on any array
    whose first axis is the output rows (floats, biases, block bytes, per-row scales)."""
    return _regroup_rows(rows, n_head, 3, "hkm", (0, 1), "qkv_heads_to_gguf", "q, k and v")


def qkv_heads_from_gguf(rows: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of ``qkv_heads_to_gguf``: ``[3, n_head, head_dim]`` rows back to ``[n_head, 3, head_dim]``."""
    return _regroup_rows(rows, n_head, 3, "khm", (0, 1), "qkv_heads_from_gguf", "q, k and v")


# (GGUF key after "{arch}.", transformers config key, kind): written by ``metadata``, read back by
# ``config_from_metadata``
HPARAMS = (
    ("context_length", "max_position_embeddings", "u32"),
    ("embedding_length", "hidden_size", "u32"),
    ("block_count", "num_hidden_layers", "u32"),
    ("feed_forward_length", "intermediate_size", "u32"),
    ("attention.head_count", "num_attention_heads", "u32"),
    ("attention.head_count_kv", "num_key_value_heads", "u32"),
    ("attention.key_length", "head_dim", "u32"),
    ("attention.value_length", "head_dim", "u32"),
    ("rope.dimension_count", "rotary_dim", "u32"),  # head_dim, times partial_rotary_factor (Arch.partial_rotary)
    ("rope.freq_base", "rope_theta", "f32"),
    ("attention.layer_norm_rms_epsilon", "rms_norm_eps", "f32"),
    ("vocab_size", "vocab_size", "u32"),
)


def metadata(arch: str, cfg: dict, *, experts: bool = False) -> dict:
    """``{gguf key: (value, kind)}`` of the hyperparameters llama.cpp's ``arch`` graph reads, from a transformers
    ``config.to_dict()``; kind is ``u32``, ``f32``, ``bool`` or ``str``. ValueError naming the setting the graph
    cannot run (rope scaling other than none/linear, biases it has no tensor for, another activation, a partial
    rotary factor outside ``Arch.partial_rotary``, a setting other than ``Arch.requires``). Config keys spelled the
    family's own way are read through ``Arch.config_aliases``; ``Arch.skip_hparams`` are not written. A sliding
    attention window narrower than ``max_position_embeddings`` is written as is where llama.cpp's graph slides it
    on the same layers (``Arch.swa_pattern``, Gemma2); elsewhere (Mistral as ``llama``, Phi-3) it caps
    ``context_length`` to the window: within it sliding attention is full attention, which is what llama.cpp's
    graph computes.
    ``experts``: the model has mixture-of-experts layers (``Arch.moe_layer``): the expert metadata
    (``Arch.moe_hparams``) is written, and routing the graph does not compute is refused (``norm_topk_prob``
    other than ``Arch.moe_norm_topk``, dense layers among the sparse ones)."""
    if arch not in ARCHS:
        raise ValueError(f"GGUF architecture {arch!r} is not one qcore writes; expected one of {sorted(ARCHS)}")
    a = ARCHS[arch]
    cfg = _canonical_config(a, cfg)

    def need(k):
        if cfg.get(k) is None:
            raise ValueError(f"the model config has no {k!r}, which GGUF's {arch} metadata needs")
        return cfg[k]
    n_head = int(need("num_attention_heads"))
    hidden = int(need("hidden_size"))
    head_dim = int(cfg.get("head_dim") or hidden // n_head)
    for k, want in a.requires:
        if cfg.get(k) is not None and cfg[k] != want:
            raise ValueError(f"the model config sets {k}={cfg[k]!r}; llama.cpp's {arch} graph computes the model "
                             f"{k}={want!r} describes")
    if cfg.get("attention_bias") and not {"attn_q", "attn_qkv"} & set(a.biases):
        raise ValueError(f"the model config sets attention_bias=True; llama.cpp's {arch} graph has no attention "
                         f"biases")
    if cfg.get("mlp_bias"):
        raise ValueError(f"the model config sets mlp_bias=True; llama.cpp's {arch} graph has no MLP biases")
    act = cfg.get("hidden_act") or cfg.get("hidden_activation")
    if act not in a.acts:
        raise ValueError(f"the model config's hidden_act is {act!r}; llama.cpp's {arch} graph computes "
                         f"{' / '.join(a.acts)}")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}  # transformers 5 / 4 spelling
    if "full_attention" in rope or "sliding_attention" in rope:  # one rope per layer type (Gemma3)
        local = rope.get("sliding_attention") or {}
        if (a.swa_rope_theta is None or local.get("rope_type", "default") != "default"
                or float(local.get("rope_theta", 0)) != a.swa_rope_theta or not _same_swa_layers(a, cfg)):
            raise ValueError(f"rope per layer type {rope!r} (layer_types {cfg.get('layer_types')}): llama.cpp's "
                             f"{arch} graph uses plain rope of base {a.swa_rope_theta} on the sliding layers of its "
                             f"own pattern (every {a.swa_pattern}th layer global)")
        rope = rope.get("full_attention") or {}
    rtype = rope.get("rope_type", rope.get("type", "default"))
    theta = rope.get("rope_theta", cfg.get("rope_theta", 10000.0))
    if rtype not in ("default", "linear"):
        raise ValueError(f"rope scaling {rope!r} is not written to GGUF by qcore (only plain and linear rope)")
    rotary = float(rope.get("partial_rotary_factor", 1.0))
    if rotary != 1.0 and not a.partial_rotary:
        raise ValueError(f"the model config rotates part of each head (partial_rotary_factor "
                         f"{rope['partial_rotary_factor']}); qcore writes full rotary only for llama.cpp's {arch} "
                         f"graph")
    for k in a.head_dim_keys:
        if cfg.get(k) is not None and int(cfg[k]) != head_dim:
            raise ValueError(f"the model config's {k} is {cfg[k]}; llama.cpp's {arch} graph scales q by "
                             f"1 / sqrt(head_dim) ({head_dim})")
    if experts:
        _check_moe(a, arch, cfg)
    ctx = int(need("max_position_embeddings"))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None
    if window and a.swa_rope_theta is not None and not _same_swa_layers(a, cfg):
        raise ValueError(f"the model's layer_types {cfg.get('layer_types')} are not llama.cpp's {arch} pattern "
                         f"(every {a.swa_pattern}th layer global)")
    if window and not _same_swa_layers(a, cfg):
        ctx = min(ctx, int(window))
    ffn = cfg.get("intermediate_size")
    vals = {"max_position_embeddings": ctx, "hidden_size": hidden, "num_hidden_layers": need("num_hidden_layers"),
            "intermediate_size": (need("intermediate_size") if ffn is not None or not a.ffn_mult
                                  else a.ffn_mult * hidden),
            "num_attention_heads": n_head, "num_key_value_heads": cfg.get("num_key_value_heads") or n_head,
            "head_dim": head_dim, "rotary_dim": int(head_dim * rotary), "rope_theta": theta,
            "vocab_size": need("vocab_size")}
    out = {}
    for key, hf, kind in HPARAMS:
        if key in a.skip_hparams or (key in ("attention.key_length", "attention.value_length")
                                     and head_dim == hidden // n_head):
            continue
        v = vals[hf] if hf in vals else need(hf)
        out[f"{arch}.{key}"] = (_kind_value(v, kind), kind)
    for key, hf, kind in a.hparams:
        out[f"{arch}.{key}"] = (_kind_value(need(hf), kind), kind)
    for key, hf, kind in (a.moe_hparams if experts else ()):
        out[f"{arch}.{key}"] = (int(need(hf)), kind)
    if rtype == "linear":
        out[f"{arch}.rope.scaling.type"] = ("linear", "str")
        out[f"{arch}.rope.scaling.factor"] = (float(rope["factor"]), "f32")
    return out


def _kind_value(v, kind: str):
    return int(v) if kind == "u32" else bool(v) if kind == "bool" else float(v)


def _canonical_config(a: Arch, cfg: dict) -> dict:
    """``cfg`` with the hyperparameters the family spells its own way (``Arch.config_aliases``) also under
    qcore's names (GPT-2's ``n_embd`` as ``hidden_size``)."""
    if not a.config_aliases:
        return cfg
    out = dict(cfg)
    for canon, own in a.config_aliases:
        if out.get(own) is not None:
            out[canon] = out[own]
    return out


def _check_moe(a: Arch, arch: str, cfg: dict) -> None:
    """ValueError for mixture-of-experts routing llama.cpp's ``arch`` graph does not compute."""
    if a.moe_layer is None:
        raise ValueError(f"llama.cpp's {arch} graph has no mixture-of-experts layers")
    norm = cfg.get("norm_topk_prob")
    if norm is not None and bool(norm) != a.moe_norm_topk:
        raise ValueError(f"the model config sets norm_topk_prob={bool(norm)}; llama.cpp's {arch} graph "
                         f"{'renormalizes' if a.moe_norm_topk else 'does not renormalize'} the top-k routing weights")
    if cfg.get("decoder_sparse_step", 1) not in (None, 1) or cfg.get("mlp_only_layers"):
        raise ValueError(f"the model config has dense MLP layers among the experts (decoder_sparse_step "
                         f"{cfg.get('decoder_sparse_step')}, mlp_only_layers {cfg.get('mlp_only_layers')}); llama.cpp's "
                         f"{arch} graph has experts in every layer")


def _same_swa_layers(a: Arch, cfg: dict) -> bool:
    """Whether llama.cpp's graph slides the window on exactly the layers transformers does (``layer_types``)."""
    types = cfg.get("layer_types")
    if not a.swa_pattern or not types:
        return False
    want = ["sliding_attention" if i % a.swa_pattern < a.swa_pattern - 1 else "full_attention"
            for i in range(len(types))]
    return list(types) == want


def llama_metadata(cfg: dict) -> dict:
    """``metadata("llama", cfg)``: the Llama hyperparameters from a ``LlamaConfig.to_dict()``."""
    return metadata("llama", cfg)


def config_from_metadata(arch: str, fields: dict) -> dict:
    """The transformers config arguments of a GGUF file's ``{arch}.*`` metadata (``fields``: key -> value), the
    inverse of ``metadata`` (``rope_parameters`` for the rope, with ``partial_rotary_factor`` where
    ``rope.dimension_count`` is less than ``head_dim`` and the graph rotates part of each head; ``head_dim`` from
    ``attention.key_length``, else ``hidden_size / head_count``; with ``{arch}.expert_count`` the expert keys
    ``Arch.moe_hparams`` and ``norm_topk_prob``); keys the family spells its own way (``Arch.config_aliases``)
    under its names, none for ``Arch.skip_hparams``. ValueError naming a missing key or a rope qcore does not
    read."""
    out = {}
    a = ARCHS.get(arch)
    extra = a.hparams if a is not None else ()
    skip = a.skip_hparams if a is not None else ()
    moe = a is not None and f"{arch}.expert_count" in fields
    if moe:
        extra = extra + a.moe_hparams
        out["norm_topk_prob"] = a.moe_norm_topk
        for key, hf, _ in a.moe_hparams:
            if fields.get(f"{arch}.{key}") is None:
                raise ValueError(f"the file has {arch}.expert_count but no {arch}.{key} metadata")
    for key, hf, kind in HPARAMS + extra:
        v = fields.get(f"{arch}.{key}")
        if v is None or key in skip:
            continue
        out.setdefault(hf, _kind_value(v, kind))
    for hf in ("max_position_embeddings", "hidden_size", "num_hidden_layers", "intermediate_size",
               "num_attention_heads"):
        if hf not in out:
            key = next(k for k, h, _ in HPARAMS if h == hf)
            raise ValueError(f"the file has no {arch}.{key!s} metadata")
    if f"{arch}.attention.key_length" not in fields:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    head_dim = out["head_dim"]
    rotary = out.pop("rotary_dim", head_dim)
    if "attention.key_length" in skip:
        del out["head_dim"]
    if "attention.head_count_kv" not in skip:
        out.setdefault("num_key_value_heads", out["num_attention_heads"])
    for k in (a.head_dim_keys if a is not None else ()):
        out[k] = head_dim
    rope = {"rope_type": "default", "rope_theta": out.pop("rope_theta", 10000.0)}
    if rotary != head_dim:
        f = rotary / head_dim
        if a is None or not a.partial_rotary or not 0 < rotary < head_dim or int(head_dim * f) != rotary:
            raise ValueError(f"{arch}.rope.dimension_count is {rotary} for heads of {head_dim}; qcore reads partial "
                             f"rotary for {sorted(n for n, x in ARCHS.items() if x.partial_rotary)} only")
        rope["partial_rotary_factor"] = f
    st = fields.get(f"{arch}.rope.scaling.type")
    if st not in (None, "none", "linear"):
        raise ValueError(f"{arch}.rope.scaling.type is {st!r}; qcore reads plain and linear rope")
    if st == "linear":
        rope.update(rope_type="linear", factor=float(fields[f"{arch}.rope.scaling.factor"]))
    swa = a.swa_rope_theta if a is not None else None
    if "rope.freq_base" not in skip:
        out["rope_parameters"] = rope if swa is None else {
            "full_attention": rope, "sliding_attention": {"rope_type": "default", "rope_theta": swa}}
    for canon, own in (a.config_aliases if a is not None else ()):
        if canon in out:
            out[own] = out.pop(canon)
    return out


# ---------------------------------------------------------------------------------------------------------------
# the loading gate: the file's structure (``read_header`` / ``check_file``), then the model it describes
# (``check_model_file``), checked before any reader (gguf-py's GGUFReader memory-maps the whole file, transformers
# and qcore build a model from the header's numbers) touches it
# ---------------------------------------------------------------------------------------------------------------

# every ggml type id -> (elements per block, bytes per block) (ggml.c's type_traits; gguf-py's GGML_QUANT_SIZES)
GGML_SIZES = {0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34), 9: (32, 40),
              10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210), 15: (256, 292),
              16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18), 21: (256, 110),
              22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4), 27: (1, 8), 28: (1, 8),
              29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17), 40: (64, 36), 41: (128, 18)}
#: ggml type id -> name (gguf-py's ``GGMLQuantizationType``)
GGML_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1", 10: "Q2_K",
              11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS",
              19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32",
              27: "I64", 28: "F64", 29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4",
              41: "Q1_0"}
#: the types a model's tensor may have: F32 / F16 / BF16, or a block type gguf-py dequantizes (what transformers'
#: GGUF reader and ``from_gguf(dequantize_other=True)`` dequantize with). ggml's dot-product intermediates
#: (Q8_1, Q8_K), integer and F64 tensors and Q1_0 are no weights any of qcore's readers can read.
WEIGHT_TYPES = frozenset({0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 16, 17, 18, 19, 20, 21, 22, 23, 29, 30, 34, 35, 39,
                          40})
# GGUF metadata value types -> fixed byte size (8 = string, 9 = array)
_KV_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
#: GGUF metadata value type -> name (gguf-py's ``GGUFValueType``)
VALUE_TYPES = {0: "uint8", 1: "int8", 2: "uint16", 3: "int16", 4: "uint32", 5: "int32", 6: "float32", 7: "bool",
               8: "string", 9: "array", 10: "uint64", 11: "int64", 12: "float64"}
_NP_TYPES = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "u1", 10: "<u8", 11: "<i8",
             12: "<f8"}
_INT_TYPES = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_FLOAT_TYPES = frozenset({6, 12})
_MAX_DIMS = 4  # GGML_MAX_DIMS


class _Cursor:
    """Bounds-checked little-endian reads of a file's header (every count checked against the bytes left)."""

    def __init__(self, f, size: int, where: str):
        self.f, self.size, self.where, self.pos = f, size, where, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or n > self.size - self.pos:
            raise CorruptCheckpointError(f"{self.where}: {what} needs {n} bytes at offset {self.pos}, but the file "
                                         f"has {self.size - self.pos} left (a truncated or corrupted header)")
        b = self.f.read(n)
        if len(b) != n:
            raise CorruptCheckpointError(f"{self.where}: the file shrank while its header was read")
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return int.from_bytes(self.take(4, what), "little")

    def u64(self, what: str) -> int:
        return int.from_bytes(self.take(8, what), "little")

    def count(self, what: str, min_bytes: int) -> int:
        """A uint64 count of items each at least ``min_bytes`` long: refused when the rest of the file could not
        hold that many (before anything is allocated for them)."""
        n = self.u64(what)
        if n * max(1, min_bytes) > self.size - self.pos:
            raise CorruptCheckpointError(f"{self.where}: {what} is {n}, more than the {self.size - self.pos} bytes "
                                         f"left in the file can hold")
        return n

    def text(self, what: str) -> str:
        """A length-prefixed UTF-8 string (gguf-py decodes keys, names and string values strictly)."""
        b = self.take(self.count(f"the length of {what}", 1), what)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError as e:
            raise CorruptCheckpointError(f"{self.where}: {what} is not UTF-8 text (byte {e.start} of "
                                         f"{b[:40]!r})") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """One metadata value: a Python int / float / bool / str; an array: a read-only numpy array (numbers) or
        a tuple of str."""
        if vtype in _KV_SIZES:
            v = np.frombuffer(self.take(_KV_SIZES[vtype], what), _NP_TYPES[vtype])[0]
            return bool(v) if vtype == 7 else v.item()
        if vtype == 8:
            return self.text(what)
        if vtype == 9:
            if depth > 0:
                raise CorruptCheckpointError(f"{self.where}: {what} is an array of arrays nested deeper than GGUF "
                                             f"readers accept")
            etype = self.u32(f"the element type of {what}")
            if etype not in _KV_SIZES and etype not in (8, 9):
                raise CorruptCheckpointError(f"{self.where}: {what} has unknown element type {etype}")
            n = self.count(f"the length of array {what}", _KV_SIZES.get(etype, 8 if etype == 8 else 12))
            if etype in _KV_SIZES:
                a = np.frombuffer(self.take(n * _KV_SIZES[etype], what), _NP_TYPES[etype])
                return a.astype(bool) if etype == 7 else a
            return tuple(self.value(etype, f"{what}[{i}]", depth + 1) for i in range(n))
        raise CorruptCheckpointError(f"{self.where}: {what} has unknown value type {vtype}")


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a checked GGUF file: ``dims`` in ggml's order, the type id, its byte range in the file."""

    name: str
    type_id: int
    dims: tuple
    begin: int
    end: int

    @property
    def shape(self) -> tuple:
        """numpy's order (the row length last): ``[out, in]`` for a Linear weight."""
        return tuple(reversed(self.dims))

    @property
    def type_name(self) -> str:
        return GGML_NAMES[self.type_id]


@dataclass(frozen=True, eq=False)
class MetaField:
    """One metadata entry: its GGUF value ``type`` (``VALUE_TYPES``), ``item_type`` for an array, the ``value``
    (int / float / bool / str; an array: a read-only numpy array, or a tuple of str) and ``raw``: its bytes as
    stored after the type (what ``metadata_differences`` compares)."""

    type: int
    value: object
    raw: bytes
    item_type: Optional[int] = None

    def describe(self) -> str:
        """A short description: ``uint32 30``, ``string 'apache-2.0'``, ``array of 49152 string``."""
        if self.type == 9:
            return f"array of {len(self.value)} {VALUE_TYPES[self.item_type]}"
        v = repr(self.value)
        return f"{VALUE_TYPES[self.type]} {v if len(v) <= 60 else v[:57] + '...'}"


@dataclass(frozen=True, eq=False)
class GGUFHeader:
    """A GGUF file's header, checked (``read_header``): ``fields`` (key -> ``MetaField``, in the file's order),
    ``tensors`` (``TensorSpan``, in the file's order), the data ``alignment`` and where the data starts."""

    path: str
    size: int
    version: int
    alignment: int
    data_start: int
    fields: dict
    tensors: tuple

    def get(self, key: str, default=None):
        """The value of metadata ``key`` (``default`` when the file has none)."""
        f = self.fields.get(key)
        return default if f is None else f.value

    def tensor(self, name: str) -> Optional[TensorSpan]:
        return next((t for t in self.tensors if t.name == name), None)


def read_header(path) -> GGUFHeader:
    """Read and check a GGUF file's header before any reader maps it: the magic and version; every count
    (metadata entries, tensors, array and string lengths) no larger than the rest of the file could hold (checked
    before anything is allocated for it); known value and tensor types, at most 4 dimensions; keys, names and
    string values UTF-8; no metadata key and no tensor name given twice (gguf-py would keep both under a made-up
    name); ``general.alignment`` a uint32 power of two; each tensor's byte range aligned, inside the file and
    overlapping no other. ``CorruptCheckpointError`` (a ``ValueError``) naming the file and the tensor or key,
    so a truncated download fails here, naming the tensor it cuts."""
    import os
    import pathlib
    p = pathlib.Path(path)
    where = str(p)
    size = os.path.getsize(p)
    fields: dict = {}
    with open(p, "rb") as f:
        c = _Cursor(f, size, where)
        if c.take(4, "the magic") != b"GGUF":
            raise CorruptCheckpointError(f"{where}: not a GGUF file (no GGUF magic)")
        version = c.u32("the version")
        if version not in (2, 3):
            raise CorruptCheckpointError(f"{where}: GGUF version {version}; GGUF readers read versions 2 and 3")
        n_tensors = c.count("the tensor count", 4 + 8 + 4 + 8 + 8)  # name length, >= 1 dim, type, offset
        n_kv = c.count("the metadata entry count", 8 + 4 + 1)
        for i in range(n_kv):
            key = c.text(f"metadata key {i}")
            if key in fields:
                raise CorruptCheckpointError(f"{where}: metadata key {key!r} appears twice")
            if key.startswith("GGUF."):
                raise CorruptCheckpointError(f"{where}: metadata key {key!r}: the GGUF. prefix is gguf-py's own "
                                             f"(the header's version and counts)")
            vtype = c.u32(f"the type of metadata {key!r}")
            start = c.pos
            v = c.value(vtype, f"metadata {key!r}")
            end = c.pos
            f.seek(start)
            raw = f.read(end - start)
            f.seek(end)
            fields[key] = MetaField(vtype, v, raw, int.from_bytes(raw[:4], "little") if vtype == 9 else None)
        al = fields.get("general.alignment")
        alignment = 32
        if al is not None:
            if al.type != 4 or al.value <= 0 or al.value & (al.value - 1):
                raise CorruptCheckpointError(f"{where}: metadata 'general.alignment' must be a uint32 power of "
                                             f"two, got {al.describe()}")
            alignment = al.value
        spans, seen = [], set()
        for i in range(n_tensors):
            name = c.text(f"the name of tensor {i}")
            if name in seen:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} appears twice")
            seen.add(name)
            nd = c.u32(f"the dimension count of tensor {name!r}")
            if not 1 <= nd <= _MAX_DIMS:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has {nd} dimensions; GGUF allows 1 to "
                                             f"{_MAX_DIMS}")
            dims = tuple(c.u64(f"a dimension of tensor {name!r}") for _ in range(nd))
            tid = c.u32(f"the type of tensor {name!r}")
            if tid not in GGML_SIZES:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has unknown ggml type {tid}")
            off = c.u64(f"the data offset of tensor {name!r}")
            blk, nb = GGML_SIZES[tid]
            n = 1
            for dd in dims:
                n *= dd
            if dims[0] % blk:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} has {dims[0]} elements per row, not a "
                                             f"multiple of its type's block of {blk}")
            if off % alignment:
                raise CorruptCheckpointError(f"{where}: tensor {name!r} starts at data offset {off}, not a multiple "
                                             f"of the alignment {alignment}")
            spans.append((name, tid, dims, off, off + n // blk * nb))
        start = -(-c.pos // alignment) * alignment
    for name, tid, dims, b, e in spans:
        if start + e > size:
            raise CorruptCheckpointError(f"{where}: the data of tensor {name!r} runs to byte {start + e}, past the "
                                         f"end of the file ({size} bytes): the file is truncated or corrupted")
    end_prev, prev = 0, None
    for name, tid, dims, b, e in sorted(spans, key=lambda s: (s[3], s[4])):
        if b < end_prev:
            raise CorruptCheckpointError(f"{where}: the data of tensor {name!r} (bytes {start + b}..{start + e}) "
                                         f"overlaps tensor {prev!r}'s")
        if b - end_prev >= alignment:  # writers pad each tensor to the alignment, no more
            raise CorruptCheckpointError(f"{where}: {b - end_prev} unaccounted bytes before tensor {name!r}"
                                         f"{f' (after {prev!r})' if prev else ''}: a tensor's type or shape does not "
                                         f"match its data")
        end_prev, prev = e, name
    if size - (start + end_prev) >= alignment and spans:
        raise CorruptCheckpointError(f"{where}: {size - start - end_prev} unexpected bytes after the last tensor "
                                     f"{prev!r}: a tensor's type or shape does not match its data")
    return GGUFHeader(where, size, version, alignment, start, fields,
                      tuple(TensorSpan(name, tid, dims, start + b, start + e) for name, tid, dims, b, e in spans))


def check_file(path) -> tuple:
    """``read_header(path).tensors``: the file's structure checked (see ``read_header``), its tensors
    (``TensorSpan``, in the file's order). What every reader of a GGUF file that is not a model (an importance
    matrix, a tokenizer, ``qcore inspect``) passes first; a model file passes ``check_model_file``."""
    return read_header(path).tensors


# ---------------------------------------------------------------------------------------------------------------
# the model a GGUF file describes
# ---------------------------------------------------------------------------------------------------------------

#: the hyperparameters that are counts or sizes: each an integer >= 1 (``{arch}.`` + key)
_AT_LEAST_ONE = frozenset({"context_length", "embedding_length", "block_count", "feed_forward_length",
                           "attention.head_count", "attention.head_count_kv", "attention.key_length",
                           "attention.value_length", "rope.dimension_count", "vocab_size", "expert_count",
                           "expert_used_count", "expert_feed_forward_length", "expert_shared_feed_forward_length",
                           "attention.sliding_window"})
#: the float hyperparameters: each finite and > 0 (epsilons, rope base and factor, soft-capping)
_POSITIVE_FLOATS = frozenset({"rope.freq_base", "attention.layer_norm_rms_epsilon", "attention.layer_norm_epsilon",
                              "attn_logit_softcapping", "final_logit_softcapping", "rope.scaling.factor"})
#: metadata outside ``{arch}.*`` whose value type readers rely on: key -> (allowed value types, element types)
_TYPED_KEYS = {"general.architecture": ({8}, None), "general.name": ({8}, None),
               "general.file_type": (_INT_TYPES, None), "general.quantization_version": (_INT_TYPES, None),
               "tokenizer.ggml.model": ({8}, None), "tokenizer.ggml.pre": ({8}, None),
               "tokenizer.ggml.tokens": ({9}, {8}), "tokenizer.ggml.merges": ({9}, {8}),
               "tokenizer.ggml.token_type": ({9}, _INT_TYPES), "tokenizer.ggml.scores": ({9}, _FLOAT_TYPES),
               "tokenizer.chat_template": ({8}, None)}
_KIND_TYPES = {"u32": _INT_TYPES, "f32": _FLOAT_TYPES, "bool": frozenset({7}), "str": frozenset({8})}


@dataclass(frozen=True, eq=False)
class GGUFModel:
    """A GGUF model file that passed ``check_model_file``: its ``header``, llama.cpp's architecture ``arch``,
    whether it has mixture-of-experts layers (``{arch}.expert_count``) and ``config``, the transformers config
    arguments of its metadata (``config_from_metadata``)."""

    header: GGUFHeader
    arch: str
    experts: bool
    config: dict

    @property
    def path(self) -> str:
        return self.header.path


def _type_names(types) -> str:
    return " / ".join(VALUE_TYPES[t] for t in sorted(types))


def check_model_file(path) -> GGUFModel:
    """The loading gate of a GGUF model file, before any reader builds a model from its numbers: the structure
    (``read_header``), then the model it describes:

    - ``general.architecture`` a string naming an architecture qcore's records describe (``ARCHS``; another one,
      even one transformers' GGUF reader reads, is refused: nothing would check that the file holds every tensor
      that model needs, and a missing one would be randomly initialised);
    - every hyperparameter the architecture reads (``HPARAMS`` and the architecture's own) of its type (an integer,
      a float, a bool, a string) and a single value; counts and sizes >= 1 (context length, embedding length,
      block count, feed-forward lengths, head counts, key / value lengths, rope dimensions, vocab size, expert
      counts, sliding window); epsilons, rope base and factor, soft-capping finite and > 0;
    - consistency with the tensors (each bounded by the file's size, so no number of the header can ask for more
      memory than the file holds): ``token_embd.weight`` ``[vocab, embedding_length]`` (``vocab_size`` its rows);
      tensors of exactly the layers ``0 .. block_count - 1``; the attention heads: ``head_count_kv`` dividing
      ``head_count``, ``head_count`` dividing the embedding length unless ``attention.key_length`` gives the head
      size, the value length the key length, layer 0's ``attn_q`` / ``attn_k`` / ``attn_qkv`` rows those heads
      times the head size; ``rope.dimension_count`` at most the head size; ``expert_used_count`` at most
      ``expert_count``, layer 0's router ``ffn_gate_inp`` one row per expert; learned positions
      (``position_embd``) one row per ``context_length``;
    - the tokenizer metadata (``tokenizer.ggml.*``) of its types, as many tokens as ``token_embd`` has rows (what
      llama.cpp requires), token types and scores one per token, special token ids inside the vocabulary;
    - then ``config_from_metadata`` (a rope qcore does not read, a missing hyperparameter).

    Returns a ``GGUFModel``. ``CorruptCheckpointError`` (a ``ValueError``) of one line naming the file and the key
    or tensor. Which tensors the model needs, with their shapes and types, is the family record's knowledge
    (``qcore.adapters.io.gguf.check_gguf_file`` checks them on top of this)."""
    h = read_header(path)
    where = h.path

    def bad(msg: str):
        return CorruptCheckpointError(f"{where}: {msg}")

    for key, (types, items) in _TYPED_KEYS.items():
        f = h.fields.get(key)
        if f is not None and (f.type not in types or (items is not None and f.item_type not in items)):
            want = _type_names(types) if items is None else f"an array of {_type_names(items)}"
            raise bad(f"metadata {key!r} is {f.describe()}; readers expect {want}")
    arch = h.get("general.architecture")
    if arch is None:
        raise bad("the file has no general.architecture metadata: not a model (an importance matrix?)")
    if arch not in ARCHS:
        raise bad(f"general.architecture is {arch!r}; qcore reads GGUF models of the architectures its records "
                  f"describe, {sorted(ARCHS)} (another reader may know {arch!r}, but nothing would check that the "
                  f"file holds every tensor such a model needs: a missing one would be randomly initialised)")
    a = ARCHS[arch]
    experts = f"{arch}.expert_count" in h.fields
    kinds = {key: kind for key, _, kind in HPARAMS + a.hparams + a.moe_hparams}
    kinds.update({"rope.scaling.type": "str", "rope.scaling.factor": "f32"})
    vals: dict = {}
    for key, kind in kinds.items():
        f = h.fields.get(f"{arch}.{key}")
        if f is None:
            continue
        if f.type not in _KIND_TYPES[kind]:
            raise bad(f"metadata '{arch}.{key}' is {f.describe()}; qcore and llama.cpp read it as one "
                      f"{_type_names(_KIND_TYPES[kind])} value")
        v = f.value
        if key in _AT_LEAST_ONE and v < 1:
            raise bad(f"metadata '{arch}.{key}' is {v}; it must be at least 1")
        if key in _POSITIVE_FLOATS and not (np.isfinite(v) and v > 0):
            raise bad(f"metadata '{arch}.{key}' is {v!r}; it must be finite and > 0")
        vals[key] = v

    def tensor_dims(name: str, nd: int) -> Optional[tuple]:
        t = h.tensor(name)
        if t is None:
            return None
        if len(t.dims) != nd:
            raise bad(f"tensor {name!r} has shape {list(t.shape)}; the {arch} model needs a {nd}-D tensor there")
        return t.dims

    emb = tensor_dims("token_embd.weight", 2)
    if emb is None:
        raise bad("the file has no tensor 'token_embd.weight' (the token embedding every model reads first)")
    hidden, vocab = vals.get("embedding_length"), emb[1]
    if hidden is None:
        raise bad(f"the file has no {arch}.embedding_length metadata")
    if hidden != emb[0]:
        raise bad(f"metadata '{arch}.embedding_length' is {hidden}; tensor 'token_embd.weight' has "
                  f"{list(reversed(emb))} ([vocab, embedding_length])")
    if vals.get("vocab_size", vocab) != vocab:
        raise bad(f"metadata '{arch}.vocab_size' is {vals['vocab_size']}; tensor 'token_embd.weight' has {vocab} "
                  f"rows")
    layers = set()
    for t in h.tensors:
        m = re.match(r"blk\.(\d+)\.", t.name)
        if m:
            layers.add(int(m.group(1)))
    n_layer = vals.get("block_count")
    if n_layer is None:
        raise bad(f"the file has no {arch}.block_count metadata")
    if len(layers) != n_layer or (layers and max(layers) != n_layer - 1):  # never range(n_layer): a header number
        gone = next(i for i in range(len(layers) + 1) if i not in layers)
        raise bad(f"metadata '{arch}.block_count' is {n_layer}; the file's tensors are of layers "
                  f"{_ranges(layers)}" + (f" (none of layer {gone})" if gone < min(n_layer, len(layers)) else ""))
    n_head = vals.get("attention.head_count")
    if n_head is None:
        raise bad(f"the file has no {arch}.attention.head_count metadata")
    skip = a.skip_hparams
    n_kv = n_head if "attention.head_count_kv" in skip else vals.get("attention.head_count_kv", n_head)
    if n_head % n_kv:
        raise bad(f"metadata '{arch}.attention.head_count_kv' is {n_kv}; it must divide "
                  f"{arch}.attention.head_count ({n_head})")
    head_dim = None if "attention.key_length" in skip else vals.get("attention.key_length")
    if head_dim is None:
        if hidden % n_head:
            raise bad(f"metadata '{arch}.attention.head_count' is {n_head}; it must divide "
                      f"{arch}.embedding_length ({hidden}) when no {arch}.attention.key_length gives the head size")
        head_dim = hidden // n_head
    v_len = None if "attention.value_length" in skip else vals.get("attention.value_length")
    if v_len is not None and v_len != head_dim:
        raise bad(f"metadata '{arch}.attention.value_length' is {v_len}, the head size is {head_dim}; qcore reads "
                  f"heads whose keys and values have one size")
    reads = set(a.layer) | set(a.moe_layer or ())
    for name, rows, what in (("attn_q", n_head * head_dim, "head_count x the head size"),
                             ("attn_k", n_kv * head_dim, "head_count_kv x the head size"),
                             ("attn_qkv", (n_head + 2 * n_kv) * head_dim, "(head_count + 2 head_count_kv) x the "
                                                                          "head size")):
        d = tensor_dims(f"blk.0.{name}.weight", 2) if name in reads else None
        if d is not None and d[1] != rows:
            raise bad(f"tensor 'blk.0.{name}.weight' has shape {[d[1], d[0]]}; the metadata gives {what} = {rows} rows "
                      f"(attention.head_count {n_head}, head_count_kv {n_kv}, head size {head_dim})")
    rot = vals.get("rope.dimension_count")
    if rot is not None and "rope.dimension_count" not in skip and rot > head_dim:
        raise bad(f"metadata '{arch}.rope.dimension_count' is {rot}; it must be at most the head size {head_dim}")
    if experts:
        n_exp, used = vals["expert_count"], vals.get("expert_used_count")
        if used is not None and used > n_exp:
            raise bad(f"metadata '{arch}.expert_used_count' is {used}; it must be at most {arch}.expert_count "
                      f"({n_exp})")
        d = tensor_dims("blk.0.ffn_gate_inp.weight", 2)
        if d is not None and d[1] != n_exp:
            raise bad(f"tensor 'blk.0.ffn_gate_inp.weight' (the router) has shape {[d[1], d[0]]}; metadata "
                      f"'{arch}.expert_count' is {n_exp}")
    if a.position_embd:
        d = tensor_dims("position_embd.weight", 2)
        ctx = vals.get("context_length")
        if d is not None and ctx is not None and d[1] != ctx:
            raise bad(f"metadata '{arch}.context_length' is {ctx}; tensor 'position_embd.weight' has shape "
                      f"{[d[1], d[0]]}")
    if vals.get("rope.scaling.type") == "linear" and "rope.scaling.factor" not in vals:
        raise bad(f"metadata '{arch}.rope.scaling.type' is 'linear' but the file has no {arch}.rope.scaling.factor")
    _check_tokenizer_fields(h, vocab, bad)
    try:
        config = config_from_metadata(arch, {k: f.value for k, f in h.fields.items()})
    except ValueError as e:
        raise bad(str(e)) from None
    return GGUFModel(h, arch, experts, config)


def _ranges(ints) -> str:
    """``{0, 1, 2, 5}`` -> ``0..2, 5``."""
    out, run = [], []
    for i in sorted(ints):
        if run and i != run[-1] + 1:
            out.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
            run = []
        run.append(i)
    if run:
        out.append(f"{run[0]}..{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out) or "none"


def _check_tokenizer_fields(h: GGUFHeader, vocab: int, bad) -> None:
    """The tokenizer metadata a model file holds: as many tokens as the embedding has rows (llama.cpp's rule),
    types and scores one per token, merges strings, special token ids inside the vocabulary, flags bools."""
    tokens = h.fields.get("tokenizer.ggml.tokens")
    n = None if tokens is None else len(tokens.value)
    if n is not None and n != vocab:
        raise bad(f"metadata 'tokenizer.ggml.tokens' has {n} tokens; tensor 'token_embd.weight' has {vocab} rows "
                  f"(llama.cpp needs one token per row)")
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        f = h.fields.get(key)
        if f is not None and len(f.value) != n:
            raise bad(f"metadata {key!r} has {len(f.value)} entries for "
                      f"{'no tokenizer.ggml.tokens' if n is None else f'{n} tokens'}")
    for key, f in h.fields.items():
        if not key.startswith("tokenizer.ggml."):
            continue
        if key.endswith("_token_id"):
            if f.type not in _INT_TYPES or not 0 <= f.value < vocab:
                raise bad(f"metadata {key!r} is {f.describe()}; a token id is an integer below the vocabulary "
                          f"size {vocab}")
        elif key.startswith(("tokenizer.ggml.add_", "tokenizer.ggml.remove_")) and f.type != 7:
            raise bad(f"metadata {key!r} is {f.describe()}; readers expect a bool")


# ---------------------------------------------------------------------------------------------------------------
# metadata of two files
# ---------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MetadataDifference:
    """One metadata key two GGUF files disagree on: its description in each (``MetaField.describe``; None where
    the file has no such key)."""

    key: str
    a: Optional[str]
    b: Optional[str]

    def __str__(self) -> str:
        return f"{self.key}: {self.a or 'absent'} -> {self.b or 'absent'}"


def metadata_differences(a, b) -> tuple:
    """Every metadata key whose presence, value type or stored bytes differ between GGUF files ``a`` and ``b``
    (paths or ``GGUFHeader``s; each read with ``read_header``), as ``MetadataDifference``s in ``a``'s key order,
    then the keys only ``b`` has. Empty: the two files hold the same metadata (in any order). The tensors and the
    header's counts are not metadata."""
    ha = a if isinstance(a, GGUFHeader) else read_header(a)
    hb = b if isinstance(b, GGUFHeader) else read_header(b)
    out = []
    for key, fa in ha.fields.items():
        fb = hb.fields.get(key)
        if fb is None or fa.type != fb.type or fa.raw != fb.raw:
            out.append(MetadataDifference(key, fa.describe(), None if fb is None else fb.describe()))
    out += [MetadataDifference(key, None, fb.describe()) for key, fb in hb.fields.items() if key not in ha.fields]
    return tuple(out)

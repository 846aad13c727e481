"""ONNX: qcore's quantized weights and activations as standard ONNX tensors and nodes. numpy + the ``onnx`` package
(imported when a function needs it; ``pip install qcore-numerics[onnx]``); no torch.

What maps to what (opset ``OPSET`` = 21, IR version ``IR_VERSION`` = 10: what onnxruntime >= 1.20 runs):

- **Weights, QDQ form** (``weight_qdq``): the codes as an initializer of the element's ONNX type (INT8, UINT8,
  INT4, UINT4 packed two per byte low nibble first, FLOAT8E4M3FN, FLOAT8E4M3FNUZ, FLOAT8E5M2, FLOAT8E5M2FNUZ) in
  the canonical ``[out, in, *kernel]`` layout, float32 scales (every qcore scale dtype, E8M0 included, is exactly
  a float32), the zero points (asymmetric integers) in the codes' type, and one ``DequantizeLinear``: per tensor
  (scalar scale), per output channel (``axis=0``), groups along the input axis (``axis=1, block_size=g``; a short
  last group as qcore pads it) and 2-D tiles (``PerBlock``: the scales repeated along the output axis, then
  blocked along the input axis). A unit exponent (MXINT8's ``2**-6``) is folded into the scales (exact: powers
  of two). DequantizeLinear computes ``(code - zero_point) * scale`` in float32, which is ``qcore.dequantize``
  bit for bit.
- **Weights, MatMulNBits** (``matmulnbits``, com.microsoft, 4-bit): int4 / uint4 codes with groups of 16, 32,
  64 or 128 along the input axis (or per channel / per tensor, written as blocks of the largest such size that
  divides the input) of a ``[out, in]`` matrix whose ``in`` is a multiple of the block: ``B`` uint8
  ``[out, in / bs, bs / 2]`` (int4 codes stored ``+ 8`` with zero point 8, uint4 as they are), ``scales`` float32
  ``[out * in / bs]``, ``zero_points`` packed uint8 when asymmetric. ``accuracy_level`` 0 or 1 keeps float32
  activations (exact weights); onnxruntime's 4 quantizes activations to int8 (about 1e-2 relative error).
- **Activations** (``activation_qdq``): static scales -> ``QuantizeLinear`` + ``DequantizeLinear`` (round half
  to even, saturating: qcore's static fake quantization for int8 / uint8 / int4 / uint4 / fp8, per tensor or
  per feature); ``dynamic_qdq``: dynamic symmetric integer / fp8 scales per tensor or per token composed from
  ReduceMax / Div / Round / Clip / Mul with qcore's rule (``amax / ((qmax - qmin) / 2)``, ``amax / qmax`` when
  unsigned or narrow; fp8 ``amax / max_finite`` and a saturating ``Cast`` to the fp8 type and back; scale 1 where
  amax is 0).
- **Not runnable in onnxruntime** (``unsupported_reason`` says why, and the exporter refuses with the tensor's
  name or writes the dequantized float weight when asked): fp4 / fp6 elements (ONNX's FLOAT4E2M1 has no
  DequantizeLinear kernel in onnxruntime 1.32), MX micro-exponent formats (MX9 / MX6 / MX4 / BFP16),
  two-level scales (NVFP4), int2 / int3 / other widths, stochastic rounding of activations.

``save_model`` writes a model atomically and deterministically (``SerializeToString(deterministic=True)``, a
temporary sibling renamed into place); models over 2 GB (protobuf's limit) are refused.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Optional, Sequence

import numpy as np

from qcore import PerBlock, PerChannel, PerGroup, PerTensor, QuantSpec
from qcore.cast import decode
from qcore.dtypes import FloatDType, IntDType
from qcore.rounding import RoundingMode
from qcore._fsutil import staged_file

__all__ = ["OPSET", "IR_VERSION", "MS_DOMAIN", "ONNX_TYPES", "MATMULNBITS_BLOCKS", "unsupported_reason",
           "activation_reason", "onnx_type", "Graph", "weight_qdq", "weight_onnx_values", "matmulnbits_block",
           "matmulnbits", "activation_qdq", "dynamic_qdq", "save_model", "MAX_PROTO_BYTES",
           "EXACT_SESSION_CONFIG", "ort_session"]

OPSET = 21
IR_VERSION = 10
MS_DOMAIN = "com.microsoft"
MAX_PROTO_BYTES = 2**31 - 1
MATMULNBITS_BLOCKS = (128, 64, 32, 16)

# qcore element name -> onnx.TensorProto data type name (only what onnxruntime's DequantizeLinear runs)
ONNX_TYPES = {"int8": "INT8", "uint8": "UINT8", "int4": "INT4", "uint4": "UINT4", "float8_e4m3fn": "FLOAT8E4M3FN",
              "float8_e4m3fnuz": "FLOAT8E4M3FNUZ", "float8_e5m2": "FLOAT8E5M2", "float8_e5m2fnuz": "FLOAT8E5M2FNUZ"}


def _onnx():
    try:
        import onnx
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("ONNX export needs the onnx package: pip install 'qcore-numerics[onnx]'") from None
    return onnx


def onnx_type(spec: QuantSpec) -> int:
    """The ``onnx.TensorProto`` data type of ``spec``'s codes (ValueError when ONNX has none qcore writes)."""
    reason = unsupported_reason(spec)
    if reason:
        raise ValueError(reason)
    return getattr(_onnx().TensorProto, ONNX_TYPES[spec.dtype.name])


def _spec_name(spec: QuantSpec) -> str:
    return spec.name or spec.dtype.name


def unsupported_reason(spec: QuantSpec) -> Optional[str]:
    """None when ``spec``'s weights can be written as a standard DequantizeLinear onnxruntime runs, else why not."""
    el = spec.dtype
    if spec.two_level:
        return f"{_spec_name(spec)} has two-level scales (NVFP4-style), which ONNX's DequantizeLinear cannot hold"
    if spec.subblock_shift_bits:
        return f"{_spec_name(spec)} has shared micro-exponents (MX9/MX6/MX4/BFP16), which ONNX has no operator for"
    if el.name not in ONNX_TYPES:
        if isinstance(el, FloatDType) and el.exponent_bits + el.mantissa_bits + 1 < 8:
            return (f"{_spec_name(spec)}: {el.name} elements have no DequantizeLinear in onnxruntime (FLOAT4E2M1 is "
                    f"NOT_IMPLEMENTED in onnxruntime 1.32; fp6 has no ONNX type)")
        return f"{_spec_name(spec)}: ONNX has no {el.name} tensor type onnxruntime dequantizes"
    if isinstance(spec.granularity, PerBlock) and len(spec.granularity.shape) != 2:
        return f"{_spec_name(spec)}: PerBlock {spec.granularity.shape} tiles are not 2-D"
    return None


def activation_reason(spec: QuantSpec, *, dynamic: bool) -> Optional[str]:
    """None when ``spec`` as a (static or dynamic) activation quantizer maps to ONNX ops that compute exactly what
    qcore computes, else why not."""
    r = unsupported_reason(spec)
    if r:
        return r
    if spec.rounding is not RoundingMode.NEAREST_EVEN:
        return f"{_spec_name(spec)} rounds {spec.rounding.value}; ONNX's QuantizeLinear rounds half to even"
    if dynamic and (spec.pow2_scale or spec.unit_exponent):
        return f"{_spec_name(spec)}: dynamic power-of-two (E8M0) scales have no ONNX operator"
    if spec.unit_exponent:
        return f"{_spec_name(spec)}: activations with a unit exponent are not written"
    g = spec.granularity
    if dynamic:
        if not spec.symmetric:
            return (f"dynamic {_spec_name(spec)}: asymmetric dynamic scales (min/max per call) are not composed "
                    f"from ONNX ops; only symmetric ones")
        if not isinstance(g, (PerTensor, PerChannel)) or (isinstance(g, PerChannel) and g.axis != 0):
            return f"dynamic {_spec_name(spec)} with {g!r}: only per-tensor and per-token dynamic scales are written"
        return None
    if spec.narrow_range and isinstance(spec.dtype, IntDType) and spec.dtype.signed:
        return f"{_spec_name(spec)} is narrow-range; ONNX's QuantizeLinear saturates to the full code range"
    if not isinstance(g, (PerTensor, PerChannel)):
        return f"static {_spec_name(spec)} with {g!r}: ONNX's QuantizeLinear is written per tensor or per feature"
    return None


# ---------------------------------------------------------------------------------------------------------------
# a graph under construction
# ---------------------------------------------------------------------------------------------------------------


class Graph:
    """Nodes, initializers, inputs and outputs of one ONNX graph, in the order they are added (deterministic)."""

    def __init__(self) -> None:
        self.nodes: list = []
        self.initializers: list = []
        self.inputs: list = []
        self.outputs: list = []
        self._names: set = set()
        self._count = 0
        self.domains: set = set()

    def fresh(self, base: str) -> str:
        name = base
        while name in self._names:
            self._count += 1
            name = f"{base}_{self._count}"
        self._names.add(name)
        return name

    def reserve(self, name: str) -> str:
        if name in self._names:
            raise ValueError(f"ONNX graph: the name {name!r} is used twice")
        self._names.add(name)
        return name

    def init(self, base: str, array: np.ndarray) -> str:
        """A float / integer initializer from a numpy array (its dtype kept), named ``base`` (or ``base_N``)."""
        name = self.fresh(base)
        self.initializers.append(_onnx().numpy_helper.from_array(np.ascontiguousarray(array), name))
        return name

    def init_tensor(self, base: str, make: Any) -> str:
        """An initializer ``make(name)`` (a TensorProto) named ``base`` (or ``base_N``)."""
        name = self.fresh(base)
        self.initializers.append(make(name))
        return name

    def const(self, base: str, array: Any, dtype: Any = np.float32) -> str:
        return self.init(base, np.asarray(array, dtype))

    def node(self, op: str, inputs: Sequence[str], base: str, *, n_out: int = 1, domain: str = "",
             outputs: Optional[Sequence[str]] = None, **attrs: Any):
        outs = list(outputs) if outputs is not None else [self.fresh(f"{base}_out" if n_out == 1 else f"{base}_out{i}")
                                                          for i in range(n_out)]
        if outputs is not None:
            for o in outs:
                self._names.add(o)
        if domain:
            self.domains.add(domain)
        self.nodes.append(_onnx().helper.make_node(op, list(inputs), outs, name=self.fresh(base), domain=domain or None,
                                                   **attrs))
        return outs[0] if len(outs) == 1 else outs

    def model(self, name: str, *, doc: str = "") -> Any:
        onnx = _onnx()
        h = onnx.helper
        g = h.make_graph(self.nodes, name, self.inputs, self.outputs, self.initializers)
        ops = [h.make_opsetid("", OPSET)] + [h.make_opsetid(d, 1) for d in sorted(self.domains)]
        m = h.make_model(g, opset_imports=ops, ir_version=IR_VERSION, producer_name="qcore", doc_string=doc)
        return m


# ---------------------------------------------------------------------------------------------------------------
# weights
# ---------------------------------------------------------------------------------------------------------------


def _pack4(codes: np.ndarray) -> bytes:
    c = (np.asarray(codes).reshape(-1).astype(np.int16) & 0xF).astype(np.uint8)
    if c.size % 2:
        c = np.append(c, np.uint8(0))
    return (c[0::2] | (c[1::2] << 4)).astype(np.uint8).tobytes()


def _code_tensor(name: str, codes: np.ndarray, spec: QuantSpec) -> Any:
    """An initializer holding ``codes`` (qcore's integer codes, or float codes as bytes) in the ONNX type."""
    onnx = _onnx()
    t = onnx_type(spec)
    el = spec.dtype
    shape = list(codes.shape)
    if isinstance(el, FloatDType):
        raw = np.ascontiguousarray(codes, np.uint8).tobytes()
    elif el.bits == 4:
        raw = _pack4(codes)
    else:
        raw = np.ascontiguousarray(codes, np.int8 if el.signed else np.uint8).tobytes()
    return onnx.helper.make_tensor(name, t, shape, raw, raw=True)


def _check_parts(name: str, parts: Any, spec: QuantSpec, shape: tuple) -> None:
    r = unsupported_reason(spec)
    if r:
        raise ValueError(f"ONNX export: {name}: {r}")
    if tuple(parts.codes.shape) != tuple(shape):
        raise ValueError(f"ONNX export: {name}: codes of shape {list(parts.codes.shape)}, expected {list(shape)}")
    want = spec.scale_shape(tuple(shape))
    if tuple(np.shape(parts.scales)) != tuple(want):
        raise ValueError(f"ONNX export: {name}: scales of shape {list(np.shape(parts.scales))}, expected {list(want)}")
    s = np.asarray(parts.scales, np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"ONNX export: {name}: scales must be positive and finite (found "
                         f"{s[~(np.isfinite(s) & (s > 0))].reshape(-1)[:3].tolist()})")
    if (parts.zero_points is None) != spec.symmetric:
        raise ValueError(f"ONNX export: {name}: zero points {'missing' if parts.zero_points is None else 'given'} "
                         f"for a {'symmetric' if spec.symmetric else 'asymmetric'} spec")


def _onnx_scales(parts: Any, spec: QuantSpec, shape: tuple) -> tuple[np.ndarray, Optional[np.ndarray], dict]:
    """(scales, zero points or None, DequantizeLinear attributes) in ONNX's per-tensor / per-axis / blocked form."""
    g = spec.granularity
    s = np.asarray(parts.scales, np.float32)
    if spec.unit_exponent:
        folded = (s.astype(np.float64) * 2.0**spec.unit_exponent).astype(np.float32)
        if not np.array_equal(folded.astype(np.float64), s.astype(np.float64) * 2.0**spec.unit_exponent):
            raise ValueError(f"{_spec_name(spec)}: scales times 2**{spec.unit_exponent} leave float32")
        s = folded
    zp = None if parts.zero_points is None else np.asarray(parts.zero_points, np.float32)
    nd = len(shape)
    if isinstance(g, PerTensor) or s.size == 1 and not isinstance(g, (PerGroup, PerBlock)):
        return s.reshape(()), None if zp is None else zp.reshape(()), {}
    if isinstance(g, PerChannel):
        return s.reshape(shape[0]), None if zp is None else zp.reshape(shape[0]), {"axis": 0}
    if isinstance(g, PerGroup):
        blocks = tuple(s.shape)
        if len(blocks) != nd:
            raise ValueError(f"{_spec_name(spec)}: group scales of shape {list(blocks)} for a weight of shape "
                             f"{list(shape)}")
        return s, zp, {"axis": 1, "block_size": int(g.size)}
    if isinstance(g, PerBlock):
        bo, bi = (int(v) for v in g.shape)
        axes = tuple(a % nd for a in (g.axes if getattr(g, "axes", None) else (nd - 2, nd - 1)))
        if nd != 2 or axes != (0, 1):
            raise ValueError(f"{_spec_name(spec)}: PerBlock tiles are written for 2-D weights over both axes")
        s = np.repeat(s, bo, axis=0)[:shape[0]]
        zp = None if zp is None else np.repeat(zp, bo, axis=0)[:shape[0]]
        if s.shape[1] == 1:
            return s.reshape(shape[0]), None if zp is None else zp.reshape(shape[0]), {"axis": 0}
        return s, zp, {"axis": 1, "block_size": bi}
    raise ValueError(f"unsupported granularity {g!r}")


def weight_onnx_values(parts: Any, spec: QuantSpec, shape: tuple) -> np.ndarray:
    """The float32 values ONNX's DequantizeLinear gives for the tensors ``weight_qdq`` writes (numpy; the
    report's reference)."""
    s, zp, attrs = _onnx_scales(parts, spec, shape)
    el = spec.dtype
    v = (decode(np.asarray(parts.codes, np.uint8), el) if isinstance(el, FloatDType)
         else np.asarray(parts.codes, np.float32))
    axis = attrs.get("axis")
    if axis is None:
        sb, zb = s, zp
    elif "block_size" in attrs:
        bs = attrs["block_size"]
        sb = np.repeat(s, bs, axis=axis)[tuple(slice(0, d) for d in shape)]
        zb = None if zp is None else np.repeat(zp, bs, axis=axis)[tuple(slice(0, d) for d in shape)]
    else:
        sh = [1] * len(shape)
        sh[axis] = shape[axis]
        sb, zb = s.reshape(sh), None if zp is None else zp.reshape(sh)
    if zb is not None:
        v = (v - zb).astype(np.float32)
    return (v * sb).astype(np.float32)


def _zp_array(zp: np.ndarray, spec: QuantSpec) -> np.ndarray:
    el = spec.dtype
    return np.asarray(zp, np.float32).astype(np.int16 if el.signed else np.uint16)


def weight_qdq(graph: Graph, name: str, parts: Any, spec: QuantSpec, shape: tuple, *, output: Optional[str] = None,
               ) -> str:
    """Add ``name``'s quantized weight (qcore parts, canonical layout ``shape``) to ``graph`` as initializers and
    one DequantizeLinear; returns the name of the float32 weight it computes (``output`` if given)."""
    _check_parts(name, parts, spec, shape)
    s, zp, attrs = _onnx_scales(parts, spec, shape)
    codes = graph.init_tensor(f"{name}_quantized", lambda n: _code_tensor(n, np.asarray(parts.codes), spec))
    scale = graph.init(f"{name}_scale", s)
    ins = [codes, scale]
    if zp is not None:
        ins.append(graph.init_tensor(f"{name}_zero_point", lambda n: _code_tensor(n, _zp_array(zp, spec), spec)))
    return graph.node("DequantizeLinear", ins, f"{name}_DequantizeLinear",
                      outputs=None if output is None else [output], **attrs)


def matmulnbits_block(spec: QuantSpec, shape: tuple) -> Optional[int]:
    """The MatMulNBits block size for a 2-D ``[out, in]`` weight of ``spec``, or None when MatMulNBits cannot hold
    it (not 4-bit integers, groups not 16/32/64/128 along the input, ``in`` not a multiple of the block)."""
    el = spec.dtype
    if unsupported_reason(spec) or not isinstance(el, IntDType) or el.bits != 4 or len(shape) != 2:
        return None
    if spec.unit_exponent:
        return None
    g, k = spec.granularity, shape[1]
    if isinstance(g, PerGroup):
        return int(g.size) if g.size in MATMULNBITS_BLOCKS and k % g.size == 0 else None
    if isinstance(g, (PerTensor, PerChannel)):
        return next((b for b in MATMULNBITS_BLOCKS if k % b == 0), None)
    return None


def matmulnbits(graph: Graph, name: str, parts: Any, spec: QuantSpec, shape: tuple, x: str, *,
                bias: Optional[str] = None, accuracy_level: int = 0, output: Optional[str] = None) -> str:
    """``x @ W.T (+ bias)`` as one com.microsoft MatMulNBits node for a 4-bit ``[out, in]`` weight (see
    ``matmulnbits_block``); returns the output name."""
    _check_parts(name, parts, spec, shape)
    bs = matmulnbits_block(spec, shape)
    if bs is None:
        raise ValueError(f"ONNX export: {name}: {_spec_name(spec)} with {spec.granularity!r} on a weight of shape "
                         f"{list(shape)} is not a MatMulNBits layout (4-bit integers, groups of "
                         f"{list(MATMULNBITS_BLOCKS)} along an input axis that they divide)")
    n, k = (int(d) for d in shape)
    nb = k // bs
    s = np.asarray(parts.scales, np.float32)
    s = np.broadcast_to(s.reshape(n, -1) if s.size > 1 else s.reshape(1, 1), (n, s.size // n if s.size > 1 else 1))
    s = np.repeat(s, nb // s.shape[1], axis=1) if s.shape[1] != nb else s
    s = np.ascontiguousarray(np.broadcast_to(s, (n, nb)), np.float32)
    signed = spec.dtype.signed
    u = np.asarray(parts.codes).astype(np.int16) + (8 if signed else 0)
    b = np.frombuffer(_pack4(u.reshape(n, nb, bs)), np.uint8).reshape(n, nb, bs // 2)
    ins = [x, graph.init(f"{name}_quantized", b), graph.init(f"{name}_scale", s.reshape(-1))]
    if not spec.symmetric:
        z = np.asarray(parts.zero_points, np.float32).reshape(n, -1)
        z = np.repeat(z, nb // z.shape[1], axis=1) if z.shape[1] != nb else z
        z = (z.astype(np.int16) + (8 if signed else 0))
        zb = np.frombuffer(_pack4(np.concatenate([z, np.zeros((n, nb % 2), np.int16)], axis=1)),
                           np.uint8).reshape(n, (nb + 1) // 2)
        ins.append(graph.init(f"{name}_zero_point", zb.reshape(-1)))
    elif not signed:  # uint4 symmetric: zero point 0, not MatMulNBits' default 8
        ins.append(graph.init(f"{name}_zero_point", np.zeros(n * ((nb + 1) // 2), np.uint8)))
    if bias is not None:
        ins += [""] * (5 - len(ins)) + [bias]
    return graph.node("MatMulNBits", ins, f"{name}_MatMulNBits", domain=MS_DOMAIN,
                      outputs=None if output is None else [output], K=k, N=n, bits=4, block_size=bs,
                      accuracy_level=int(accuracy_level))


# ---------------------------------------------------------------------------------------------------------------
# activations
# ---------------------------------------------------------------------------------------------------------------


def activation_qdq(graph: Graph, name: str, x: str, spec: QuantSpec, scale: np.ndarray,
                   zero_point: Optional[np.ndarray], *, axis: int = -1) -> str:
    """QuantizeLinear + DequantizeLinear of ``x`` with static ``scale`` / ``zero_point`` (scalar, or per feature
    along ``axis``); returns the dequantized output's name."""
    r = activation_reason(spec, dynamic=False)
    if r:
        raise ValueError(f"ONNX export: {name}: {r}")
    s = np.asarray(scale, np.float32)
    if not (np.isfinite(s).all() and (s > 0).all()):
        raise ValueError(f"ONNX export: {name}: static scales must be positive and finite")
    per_tensor = s.size == 1 and isinstance(spec.granularity, PerTensor)
    s = s.reshape(()) if per_tensor else s.reshape(-1)
    zp = np.zeros(s.shape, np.float32) if zero_point is None else np.asarray(zero_point, np.float32).reshape(s.shape)
    el = spec.dtype
    si = graph.init(f"{name}_scale", s)
    attrs = {} if per_tensor else {"axis": int(axis)}
    if isinstance(el, FloatDType):
        # float8: the type as output_dtype and no zero point. With a float8 zero point input onnxruntime 1.32's
        # ReluQuantFusion wrongly drops a Relu before the QuantizeLinear (it reads the zero point as uint8 0).
        q = graph.node("QuantizeLinear", [x, si], f"{name}_QuantizeLinear", output_dtype=onnx_type(spec), **attrs)
        return graph.node("DequantizeLinear", [q, si], f"{name}_DequantizeLinear", **attrs)
    zt = _zp_array(zp, spec)
    zi = graph.init_tensor(f"{name}_zero_point", lambda n: _code_tensor(n, zt, spec))
    q = graph.node("QuantizeLinear", [x, si, zi], f"{name}_QuantizeLinear", **attrs)
    return graph.node("DequantizeLinear", [q, si, zi], f"{name}_DequantizeLinear", **attrs)


def dynamic_qdq(graph: Graph, name: str, x: str, spec: QuantSpec) -> str:
    """Dynamic symmetric fake quantization of ``x`` (per tensor, or per token: one scale per row of the last
    axis), composed from standard ops with qcore's arithmetic: ``amax = max |x|``, ``scale = amax / div`` (float32
    division; integers: ``div`` = ``(qmax - qmin) / 2``, or ``qmax`` when unsigned or narrow; fp8: the largest
    finite value), 1 where amax is 0 (float32's smallest subnormal where the quotient underflows), then integers:
    ``clip(round(x / scale), qmin, qmax) * scale``; fp8: ``Cast(Cast(x / scale, fp8, saturate), float) * scale``.
    Non-finite blocks are not given qcore's NaN rule."""
    r = activation_reason(spec, dynamic=True)
    if r:
        raise ValueError(f"ONNX export: {name}: {r}")
    T = _onnx().TensorProto
    el = spec.dtype
    if isinstance(el, FloatDType):
        div = float(el.max_finite)
    else:
        qmin = -el.max if (spec.narrow_range and el.signed) else el.min
        qmax = el.max
        div = float(qmax) if (spec.narrow_range or not el.signed) else (qmax - qmin) / 2.0
    per_token = isinstance(spec.granularity, PerChannel)
    a = graph.node("Abs", [x], f"{name}_Abs")
    if per_token:
        amax = graph.node("ReduceMax", [a, graph.const(f"{name}_axes", [-1], np.int64)], f"{name}_ReduceMax",
                          keepdims=1)
    else:
        amax = graph.node("ReduceMax", [a], f"{name}_ReduceMax", keepdims=0)
    s = graph.node("Div", [amax, graph.const(f"{name}_div", np.float32(div))], f"{name}_Div")
    zero = graph.const(f"{name}_zero", np.float32(0))
    one = graph.const(f"{name}_one", np.float32(1))
    tiny = graph.const(f"{name}_tiny", np.float32(np.finfo(np.float32).smallest_subnormal))
    is0 = graph.node("Equal", [amax, zero], f"{name}_Equal")
    s0 = graph.node("Equal", [s, zero], f"{name}_ScaleZero")
    s = graph.node("Where", [s0, tiny, s], f"{name}_Underflow")
    s = graph.node("Where", [is0, one, s], f"{name}_Scale")
    y = graph.node("Div", [x, s], f"{name}_Scaled")
    if isinstance(el, FloatDType):  # round to the fp8 grid (nearest even, saturating) and back
        y = graph.node("Cast", [graph.node("Cast", [y], f"{name}_Codes", to=onnx_type(spec), saturate=1)],
                       f"{name}_CodesFloat", to=T.FLOAT)
        return graph.node("Mul", [y, s], f"{name}_Dequantized")
    y = graph.node("Round", [y], f"{name}_Round")
    y = graph.node("Clip", [y, graph.const(f"{name}_qmin", np.float32(qmin)),
                            graph.const(f"{name}_qmax", np.float32(qmax))], f"{name}_Clip")
    # the codes as integers and back: -0 becomes +0 as in qcore (an Add of 0 would be optimized away)
    y = graph.node("Cast", [graph.node("Cast", [y], f"{name}_Codes", to=T.INT32)], f"{name}_CodesFloat", to=T.FLOAT)
    return graph.node("Mul", [y, s], f"{name}_Dequantized")


# ---------------------------------------------------------------------------------------------------------------
# writing
# ---------------------------------------------------------------------------------------------------------------


def save_model(model: Any, path: "os.PathLike[str] | str", *, overwrite: bool = False, check: bool = True) -> int:
    """Write ``model`` to ``path`` atomically (``qcore._fsutil.staged_file``: staged beside, renamed into place; a
    symlink stays a link to the new file) and deterministically; returns
    the number of bytes. ``check`` runs ``onnx.checker`` first (nothing is written if it fails)."""
    onnx = _onnx()
    path = pathlib.Path(path)
    if check:
        onnx.checker.check_model(model)
    data = model.SerializeToString(deterministic=True)
    if len(data) > MAX_PROTO_BYTES:  # pragma: no cover - large models
        raise ValueError(f"the ONNX model is {len(data)} bytes, over protobuf's 2 GB limit")

    def recheck() -> None:  # the file may have appeared while we serialized
        if path.is_dir():
            raise FileExistsError(f"{str(path)!r} is a directory")
        if not overwrite:
            raise FileExistsError(f"{str(path)!r} exists; pass overwrite=True to replace it")
    if path.exists():
        recheck()
    with staged_file(path, recheck=recheck) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    return len(data)



#: onnxruntime session config entries under which it computes what the QDQ graph says (float32 DequantizeLinear /
#: QuantizeLinear, no fusion into its integer kernels, MatMulNBits with float32 activations)
EXACT_SESSION_CONFIG = {"session.disable_quant_qdq": "1", "session.qdq_matmulnbits_accuracy_level": "0"}


def ort_session(path: "os.PathLike[str] | str", *, exact: bool = True, threads: Optional[int] = None) -> Any:
    """An onnxruntime CPU ``InferenceSession`` of ``path``; ``exact=True`` applies ``EXACT_SESSION_CONFIG``
    (onnxruntime's default fuses QDQ into integer kernels and MatMulNBits with int8 activations, which round
    differently: about 5e-2 relative on the tiny models' logits)."""
    try:
        import onnxruntime as ort
    except ImportError:  # pragma: no cover - depends on the environment
        raise ImportError("running an ONNX export needs onnxruntime: pip install onnxruntime") from None
    so = ort.SessionOptions()
    if threads is not None:
        so.intra_op_num_threads = int(threads)
        so.inter_op_num_threads = 1
    if exact:
        for k, v in EXACT_SESSION_CONFIG.items():
            so.add_session_config_entry(k, v)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])

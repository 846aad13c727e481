"""The minimal failing inputs tests/fuzz/test_fuzz_onnx.py found in ``qcore inspect`` of an ONNX file
(``inspect_onnx``): a KeyError, a ZeroDivisionError and int() errors without the file, and negative or unknown
sizes reported as if valid; each is now a one-line ValueError naming the file and the initializer or node."""

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from qcore.formats.inspect import inspect_onnx  # noqa: E402


def _nbits(**attrs):
    """A one-node MatMulNBits model (4-bit, K=32, N=8, block 32)."""
    a = dict(K=32, N=8, bits=4, block_size=32)
    a.update(attrs)
    a = {k: v for k, v in a.items() if v is not None}
    w = numpy_helper.from_array(np.zeros((8, 1, 16), np.uint8), "w")
    s = numpy_helper.from_array(np.ones((8,), np.float32), "s")
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], name="mm", domain="com.microsoft", **a)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 32])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w, s])
    return helper.make_model(g)


def _qdq(dims=None, data_type=None, twice=False):
    w = numpy_helper.from_array(np.zeros((8, 32), np.int8), "w")
    s = numpy_helper.from_array(np.ones((8,), np.float32), "s")
    if dims is not None:
        del w.dims[:]
        w.dims.extend(dims)
    if data_type is not None:
        w.data_type = data_type
    node = helper.make_node("DequantizeLinear", ["w", "s"], ["y"], name="dq", axis=0)
    g = helper.make_graph([node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 32])],
                          [w, s] + ([s] if twice else []))
    return helper.make_model(g)


CASES = [
    ("K-missing", _nbits(K=None), r"node 'mm': MatMulNBits needs the attributes K and N"),
    ("K-string", _nbits(K="x"), r"node 'mm': attribute K is b?'x'; expected a positive int"),
    ("K-float", _nbits(K=1.5), r"node 'mm': attribute K is 1\.5; expected a positive int"),
    ("N-zero", _nbits(N=0), r"node 'mm': attribute N is 0; expected a positive int"),
    ("dims-negative", _qdq(dims=[-1]), r"initializer 'w' has dims \[-1\]; expected sizes >= 0"),
    ("dims-zero", _qdq(dims=[0, 32]), r"quantized weight 'w' has 0 elements"),
    ("dtype-unknown", _qdq(data_type=99), r"initializer 'w' has data_type 99, not an ONNX type"),
    ("initializer-twice", _qdq(twice=True), r"initializer 's' appears twice"),
]


@pytest.mark.parametrize("name, model, match", CASES, ids=[c[0] for c in CASES])
def test_inspect_onnx_refuses(tmp_path, name, model, match):
    p = tmp_path / "m.onnx"
    p.write_bytes(model.SerializeToString())
    with pytest.raises(ValueError, match=r"m\.onnx'?: " + match):
        inspect_onnx(p)


def test_the_sound_models_inspect(tmp_path):
    for i, m in enumerate([_nbits(), _qdq()]):
        p = tmp_path / f"{i}.onnx"
        p.write_bytes(m.SerializeToString())
        layer = inspect_onnx(p)["layers"]["w"]
        assert layer["weights"] == 256 and layer["bits_per_weight"] > 0

"""GGUF types (k-quants, Q4_0 ... Q8_0, IQ4_NL): qcore's bytes equal llama.cpp's ``ggml_quantize_chunk`` on any
finite row (|x| <= 2**39 * 1e4), with and without an importance matrix; ``unpack_gguf_blocks(pack_gguf_blocks(q))``
gives q back. Skipped without llama-cpp-python's libggml-base."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore.packing import pack_gguf_blocks, unpack_gguf_blocks
from qcore.testing.ggml import ggml_library, ggml_quantize

from ._util import examples

pytestmark = pytest.mark.skipif(ggml_library() is None, reason="llama.cpp's libggml-base is not installed")

_FINITE = st.floats(min_value=-2.0**39, max_value=2.0**39, allow_nan=False, allow_infinity=False, width=32)


@st.composite
def _row(draw):
    """One row of 256 float32 values: from a small pool (ties, repeated extremes, zeros of both signs), scaled."""
    pool = draw(st.lists(_FINITE | st.sampled_from([0.0, -0.0, 1.0, -1.0]), min_size=1, max_size=12))
    idx = draw(st.lists(st.integers(0, len(pool) - 1), min_size=256, max_size=256))
    scale = draw(st.sampled_from([1.0, 1e-3, 1e-8, 3.0, 1e4]))
    return (np.asarray(pool, np.float64)[idx] * scale).astype(np.float32)


@settings(max_examples=examples(0.1))
@given(x=_row(), use_w=st.booleans(), w_seed=st.integers(0, 2**16))
def test_gguf_bytes_equal_ggml(x, use_w, w_seed):
    x = x.reshape(1, 256)
    w = np.random.default_rng(w_seed).random(256).astype(np.float32) if use_w else None
    for name in qcore.GGUF_DTYPES:
        q = qcore.quantize(x, name, imatrix=w)
        ours = pack_gguf_blocks(q)
        assert np.array_equal(ours, ggml_quantize(x, name, w)), (name, use_w)
        back = unpack_gguf_blocks(ours, name)
        assert np.array_equal(back.codes, q.codes)
        # bits, not values: a d beyond fp16 (q4_0: |x| >= 524160) is Inf, and code 0 * Inf is NaN, as in llama.cpp
        assert np.array_equal(qcore.dequantize(back).view(np.int32), qcore.dequantize(q).view(np.int32))

"""The minimal failing inputs tests/fuzz/test_fuzz_imatrix.py found in qcore.formats.imatrix: each is now a
CorruptCheckpointError naming the file (and the entry)."""

import struct

import numpy as np
import pytest

from qcore.formats.imatrix import CorruptCheckpointError, ImatrixGGUF
from qcore.stats import ImatrixStats

NAME = "blk.0.attn_q.weight"


def _file() -> bytearray:
    return bytearray(ImatrixGGUF.from_stats({NAME: ImatrixStats(np.full((1, 64), 2.0), np.array([16]))},
                                            chunk_size=8).to_bytes())


def _tensor_info(data: bytes, tensor: str) -> int:
    """The offset of the first dimension of ``tensor`` in the header."""
    key = struct.pack("<Q", len(tensor)) + tensor.encode()
    return data.index(key) + len(key) + 4


def _counts_at(data: bytes) -> int:
    """The offset of the count: the last tensor's data (in_sum2's 256 bytes, then the counts padded to 32)."""
    return len(data) - 32


@pytest.mark.parametrize("count", [0.5, 1e-45, 3e38, 2.0 ** 63])
def test_counts_that_are_not_token_counts_are_refused(count):
    """A fractional count divided the sums up to inf (llama-quantize's weights); one past int64 wrapped when
    rounded to an int64 count."""
    b = _file()
    struct.pack_into("<f", b, _counts_at(b), count)
    with pytest.raises(CorruptCheckpointError, match=rf"^f\.gguf: '{NAME}': counts must be whole numbers in "
                                                     r"\[0, 2\*\*63\)"):
        ImatrixGGUF.from_bytes(bytes(b), where="f.gguf")


@pytest.mark.parametrize("dim", [2 ** 63, 2 ** 64 - 1])
def test_a_dimension_near_2_63_does_not_wrap(dim):
    """numpy's int64 product of the dimensions wrapped: the file was read as if the tensor were small."""
    b = _file()
    struct.pack_into("<Q", b, _tensor_info(b, f"{NAME}.in_sum2"), dim)
    with pytest.raises(CorruptCheckpointError, match=rf"^f\.gguf: the data of tensor '{NAME}\.in_sum2' runs to "
                                                     r"byte \d+, past the end of the file"):
        ImatrixGGUF.from_bytes(bytes(b), where="f.gguf")


def test_the_unchanged_file_reads():
    got = ImatrixGGUF.from_bytes(bytes(_file()), where="f.gguf")
    assert got.entries[NAME].counts.tolist() == [16.0] and got.quant_weights()[NAME].tolist() == [2.0 / 16] * 64

"""Every float32 bit pattern (2**32 of them) through cast, against ml_dtypes. About 5 minutes per format on
one core, so it runs only when asked: ``QCORE_EXHAUSTIVE=1 python -m pytest tests/qcore/test_cast_exhaustive.py``.
(CI covers the same formats at every rounding boundary and on 2**20 random bit patterns in test_cast.py.)"""

import os

import numpy as np
import pytest

from qcore import cast

from test_cast import SMALL, e8m0_known_difference, ref_cast  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("QCORE_EXHAUSTIVE") != "1",
                                reason="set QCORE_EXHAUSTIVE=1 to check all 2**32 float32 inputs")

CHUNK = 1 << 24


@pytest.mark.parametrize("name", SMALL)
def test_cast_equals_ml_dtypes_for_every_float32(name):
    mismatches = 0
    for start in range(0, 1 << 32, CHUNK):
        x = np.arange(start, start + CHUNK, dtype=np.uint64).astype(np.uint32).view(np.float32)
        x = x[~np.isnan(x)]
        exp, got = ref_cast(x, name), cast(x, name)
        diff = (exp.view(np.uint32) != got.view(np.uint32)) & ~(np.isnan(exp) & np.isnan(got))
        if name == "float8_e8m0fnu":
            diff &= ~e8m0_known_difference(x)
        mismatches += int(diff.sum())
    assert mismatches == 0

"""Properties of the per-channel scaling algorithms (``qcore.algorithms.awq`` / ``smoothquant``), numpy path.

- ``smoothquant_scales`` is the paper's rule per channel (a float64 transcription, rounded once to float32).
- ``awq_search`` is never worse than no scaling (ratio 0) on its sample, and reports that candidate's loss.
- ``awq_clip`` is never worse than the unclipped weight, group by group, and only ever shrinks magnitudes.
"""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import qcore
from qcore.algorithms.awq import awq_clip, awq_search
from qcore.algorithms.smoothquant import smoothquant_scales

from ._util import examples

_SPECS = [qcore.make_spec("uint4", granularity=qcore.PerGroup(16, axis=1)),
          qcore.make_spec("int4", granularity=qcore.PerGroup(16, axis=1)),
          qcore.make_spec("int8", axis=0),
          qcore.make_spec("mxfp4", axis=1)]


def _data(seed, t, n, out, spread):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((t, n)) * np.exp(rng.standard_normal(n) * spread)).astype(np.float32)
    w = rng.standard_normal((out, n)).astype(np.float32)
    return x, w


@settings(max_examples=examples(0.5))
@given(st.integers(0, 2**32 - 1), st.integers(1, 40), st.floats(0, 1), st.floats(1e-8, 1.0))
def test_smoothquant_scales_are_the_rule(seed, n, alpha, clamp_min):
    rng = np.random.default_rng(seed)
    act = (np.abs(rng.standard_normal(n)) * 10.0 ** rng.uniform(-6, 6, n)).astype(np.float32)
    w = (np.abs(rng.standard_normal(n)) * 10.0 ** rng.uniform(-6, 3, n)).astype(np.float32)
    act[rng.random(n) < 0.1] = 0
    w[rng.random(n) < 0.1] = 0
    s = smoothquant_scales(act, w, alpha=alpha, clamp_min=clamp_min)
    for j in range(n):
        a, b = float(act[j]), float(w[j])
        want = 1.0 if a == 0 or b == 0 else max(math.pow(a, alpha) / math.pow(b, 1 - alpha), clamp_min)
        assert s[j] == np.float32(want)


@settings(max_examples=examples(0.25))
@given(st.integers(0, 2**32 - 1), st.integers(4, 40), st.integers(8, 48), st.integers(1, 12),
       st.floats(0, 2.5), st.sampled_from(_SPECS), st.integers(1, 8))
def test_awq_search_never_worse_than_no_scaling(seed, t, n, out, spread, spec, grid):
    x, w = _data(seed, t, n, out, spread)
    r = awq_search(x, w, spec, grid=grid)
    x64 = x.astype(np.float64)
    rtn = np.mean((x64 @ (qcore.fake_quantize(w, spec).astype(np.float64) - w).T) ** 2)
    assert r.losses[0][0] == 0.0 and math.isclose(r.losses[0][1], rtn, rel_tol=1e-9, abs_tol=1e-300)
    assert r.loss <= r.losses[0][1]
    assert r.scales.dtype == np.float32 and np.all(r.scales > 0) and np.all(np.isfinite(r.scales))


@settings(max_examples=examples(0.25))
@given(st.integers(0, 2**32 - 1), st.integers(2, 40), st.integers(8, 48), st.integers(1, 12),
       st.floats(0, 2.5), st.sampled_from(_SPECS))
def test_awq_clip_never_worse_per_group(seed, t, n, out, spread, spec):
    x, w = _data(seed, t, n, out, spread)
    c = awq_clip(x, w, spec, grid=10)
    assert np.all(np.abs(c) <= np.abs(w))
    size = n if isinstance(spec.granularity, qcore.PerChannel) else spec.granularity.size
    x64 = x.astype(np.float64)
    d0 = qcore.fake_quantize(w, spec).astype(np.float64) - w
    d1 = qcore.fake_quantize(c, spec).astype(np.float64) - w
    for a in range(0, n, size):
        e0 = np.mean((x64[:, a:a + size] @ d0[:, a:a + size].T) ** 2, axis=0)
        e1 = np.mean((x64[:, a:a + size] @ d1[:, a:a + size].T) ** 2, axis=0)
        assert np.all(e1 <= e0 * (1 + 1e-9) + 1e-300)

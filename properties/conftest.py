"""Hypothesis profiles for the property suite.

``QCORE_HYPOTHESIS_PROFILE`` picks one (default ``ci``):

- ``ci``: deterministic (``derandomize=True``: the same examples on every run, no example database), no deadline,
  200 examples per test: the whole folder runs in well under a minute on 2 cores.
- ``dev``: random search, 1000 examples per test, the local example database (to hunt for new counterexamples).
- ``quick``: deterministic, 30 examples per test (a smoke run while editing).

Tests that are heavier per example scale their count from the active profile with ``properties._util.examples``.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

settings.register_profile("ci", derandomize=True, database=None, max_examples=200, print_blob=True, **_COMMON)
settings.register_profile("dev", max_examples=1000, print_blob=True, **_COMMON)
settings.register_profile("quick", derandomize=True, database=None, max_examples=30, **_COMMON)

settings.load_profile(os.environ.get("QCORE_HYPOTHESIS_PROFILE", "ci"))

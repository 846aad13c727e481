"""The kit's pytest fixtures, defined once; ``pytest_plugin`` and ``_pytest_entry`` re-export them."""

from __future__ import annotations

import pytest

from qcore.testing.oracle import Oracle


@pytest.fixture
def qcore_oracle() -> Oracle:
    """A ``qcore.testing.oracle.Oracle``: ``.probes(fmt)``, ``.probes_by_kind(fmt)``, ``.assert_matches(actual, x,
    fmt, op=Op...)``, ``.check(...)`` (the Report), ``.reference(x, fmt, op=...)``, ``.compare``,
    ``.assert_equal`` and ``.Op``."""
    return Oracle()

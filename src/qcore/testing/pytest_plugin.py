"""pytest plugin of the kernel-test kit: the ``qcore_oracle`` fixture.

Loaded automatically when qcore is installed (entry point ``pytest11: qcore``), or explicitly with
``pytest_plugins = ["qcore.testing.pytest_plugin"]`` in a top-level conftest.py, or ``-p qcore.testing.pytest_plugin``
(the entry point loads ``qcore.testing._pytest_entry``, a different module with the same fixtures, so listing
this module as well is harmless; ``-p no:qcore`` disables the entry point).
A kernel test is then a few lines::

    import pytest
    from qcore.testing import Op, formats

    @pytest.mark.parametrize("fmt", formats("block"))
    def test_my_kernel(qcore_oracle, fmt):
        x = qcore_oracle.probes(fmt)                          # remembered: mismatches name their probe kind
        qcore_oracle.assert_matches(my_kernel(x, fmt), x, fmt, op=Op.FAKE_QUANTIZE)

Loading it imports qcore and numpy (the oracle is built when the fixture is first used), never torch.
"""

from __future__ import annotations

from qcore.testing._fixtures import qcore_oracle  # noqa: F401  (the fixtures this plugin provides)

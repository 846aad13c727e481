"""The kit's fixture for these tests, whether or not qcore's pytest11 entry point is installed.

(``pytest_plugins`` may only be set in a top-level conftest, so the fixture is imported instead; a fixture
defined here simply overrides the entry point's identical one.)
"""

from qcore.testing.pytest_plugin import qcore_oracle  # noqa: F401

"""What the ``pytest11`` entry point ``qcore`` loads: the fixtures of ``qcore.testing.pytest_plugin``.

A separate module (not ``pytest_plugin`` itself) so that a project may also list
``pytest_plugins = ["qcore.testing.pytest_plugin"]`` while qcore is installed: pytest refuses to register one
module object under two names, but two modules that define the same fixture are fine.
"""

from qcore.testing._fixtures import qcore_oracle  # noqa: F401
